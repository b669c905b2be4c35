"""``celery -A proj baton web``: the store-wide view for operators, in a browser.

- ``server``: HTTP (routes, the token, read-only without it, the outage page)
- ``page``: the HTML page, rendered from the read model's state (``ops/state.py``)
- ``metrics``: ``/metrics``, Prometheus' text format
- ``actions``: the CLI's actions (unlock, pause, resume, trigger), behind the token

Celery-free, like the read model it renders.
"""
