"""The only code that talks to the store."""

from celery_baton.store.connection import Store, connect, redact_url
from celery_baton.store.scripts import Scripts

__all__ = ["Scripts", "Store", "connect", "redact_url"]
