"""The operators' side: ``celery -A proj baton ...`` (cli.py) and the web view (web.py)."""
