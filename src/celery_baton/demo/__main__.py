"""Runs the demo: ``python -m celery_baton demo``."""

from celery_baton.demo.run import main

if __name__ == "__main__":
    raise SystemExit(main())
