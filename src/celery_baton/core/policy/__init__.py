"""A task's coordination policy, compiled once from its options. Celery-free.

- ``options``: the option names, types and allowed values (one list: ``TaskOptions``)
- ``model``: ``TaskPolicy`` (a task's compiled options) and ``RunPlan`` (one delivery's)
- ``compile``: options -> ``TaskPolicy``, validated
- ``plan``: ``TaskPolicy`` + one delivery -> ``RunPlan`` (the gate's conditions)
- ``per_call``: ``baton={...}`` per-call options, and the policy a call or a beat slot
  runs under
- ``headers``: the message headers celery-baton stamps and reads
- ``slot_runs``: a scheduled beat slot that ran, recorded in one key per entry
"""
