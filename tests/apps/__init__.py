"""Celery app modules that test workers load with ``celery -A tests.apps.<name>``."""
