"""Settings of the example project: just enough Django for Celery and celery-baton.

Celery reads every ``CELERY_*`` name here (``namespace="CELERY"`` in ``proj/celery.py``),
so ``CELERY_BATON_URL`` is celery-baton's ``baton_url``, ``CELERY_BATON_LEASE_TTL`` its
``baton_lease_ttl``, and so on (docs/configuration.md).
"""

import os

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = True
ALLOWED_HOSTS: list[str] = []
# django-celery-beat: the schedule in the database, edited in the admin, fired exactly
# once by every beat you run (celery_baton.beat.django, docs/guides/django-beat.md).
INSTALLED_APPS = ["django_celery_beat", "feeds"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DJANGO_DB_PATH", "db.sqlite3"),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6379/1")
# The coordination store. Unset: $BATON_URL, else the broker's Redis (the broker above).
CELERY_BATON_URL = os.environ.get("CELERY_BATON_URL")
CELERY_BATON_LEASE_TTL = 15  # a killed worker's feeds are free again within 15 s
CELERY_BEAT_SCHEDULER = "celery_baton.beat.django:DjangoScheduler"
CELERY_BATON_BEAT_DJANGO_POLL = 1  # an admin edit is read within a second
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 4
