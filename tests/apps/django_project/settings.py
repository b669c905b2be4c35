"""Settings of the test Django project: django-celery-beat's tables in the database named
by the environment, Celery configured from the ``CELERY_*`` names below.

``DJBEAT_DB``: ``sqlite:<path>`` or ``postgresql:<database>`` (on 127.0.0.1:5432, user
postgres, trust auth). ``TEST_BROKER_URL`` / ``BATON_URL``: as every test app.
"""

import json
import os

SECRET_KEY = "tests-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_engine, _, _name = os.environ["DJBEAT_DB"].partition(":")
if _engine == "sqlite":
    # Two beats and the test's edits write the one file: wait for its lock, do not fail.
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _name,
            "OPTIONS": {"timeout": 20},
        }
    }
    import django

    if django.VERSION >= (5, 1):
        # A transaction that reads, then writes (django-celery-beat's update_or_create of
        # its change marker) cannot wait for the lock: SQLite answers "database is
        # locked" at once when it would have to upgrade a read lock that another writer
        # waits behind. Taking the write lock first makes it wait (Django's advice).
        DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _name,
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": "5432",
        }
    }

CELERY_BROKER_URL = os.environ["TEST_BROKER_URL"]
CELERY_RESULT_BACKEND = os.environ.get("TEST_RESULT_URL")
CELERY_BATON_URL = os.environ["BATON_URL"]
CELERY_TIMEZONE = "UTC"
CELERY_RESULT_EXPIRES = None
# DJBEAT_SCHEDULER: a test's subclass (killed_after_claim.py).
CELERY_BEAT_SCHEDULER = os.environ.get(
    "DJBEAT_SCHEDULER", "celery_baton.beat.django:DjangoScheduler"
)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Entries of beat_schedule stay apart from the tables: {name: seconds}, each with the
# options DJBEAT_SETTINGS_OPTIONS (JSON) names.
CELERY_BEAT_SCHEDULE = {
    name: {
        "task": "tests.apps.django_project.celery_app.record",
        "schedule": float(every),
        "args": (name,),
        "options": json.loads(os.environ.get("DJBEAT_SETTINGS_OPTIONS", "{}")),
    }
    for name, every in json.loads(os.environ.get("DJBEAT_SETTINGS_ENTRIES", "{}")).items()
}
