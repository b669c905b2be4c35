"""celery-baton: coordination for Celery."""
