"""The operators' side: one read model (``state.py``) rendered by the command line
(``cli/``: ``celery -A proj baton ...``) and the web view (``web/``)."""
