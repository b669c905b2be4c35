"""``python -m celery_baton demo``: the whole system on one machine, nothing installed."""
