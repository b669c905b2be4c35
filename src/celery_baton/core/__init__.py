"""The primitives, Celery-free: keys, the gate and its conditions, leases, rates, limits,
fairness, unique, supersede, debounce and the task policies built from them. They talk
to the store only through ``celery_baton.store`` and import nothing from Celery."""
