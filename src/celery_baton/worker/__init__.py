"""The Celery worker side: admission in the consumer, release on every completion path."""
