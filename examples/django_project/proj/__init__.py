"""The Django project. Importing it loads the Celery app, as Django's Celery guide does."""

from .celery import app as celery_app

__all__ = ("celery_app",)
