"""Test infrastructure shared by every integration test.

* :mod:`tests.support.servers` -- :class:`StoreServer`, a real ``redis-server`` / Valkey
  process on a free port that a test can stop, kill, pause and restart.
* :mod:`tests.support.celery_processes` -- real ``celery worker`` and ``celery beat``
  subprocesses; :mod:`tests.support.workers` -- the :class:`Workers` fixture class that
  starts them for a test and ends them; :mod:`tests.support.machine` -- a stand-in for
  another machine.
* :mod:`tests.support.cluster_topology`, :mod:`tests.support.sentinel_topology` -- a real
  Redis Cluster and a real Sentinel setup (what both share: :mod:`tests.support.topologies`).
* :mod:`tests.support.observer` -- the :class:`Observer` that tasks report their runs to,
  and the checkers (:func:`assert_no_overlap`, ...) that judge those runs from outside
  the code under test.

The fixtures that wire these together live in ``tests/conftest.py``.
"""
