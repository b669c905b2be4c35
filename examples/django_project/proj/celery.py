"""The Celery app, configured from the Django settings, with celery-baton installed.

Run a worker from this directory::

    celery -A proj worker --loglevel INFO
    celery -A proj baton status
"""

import os

from celery import Celery

from celery_baton import Baton

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
baton = Baton(app)  # reads CELERY_BATON_* through the namespace, on first use
