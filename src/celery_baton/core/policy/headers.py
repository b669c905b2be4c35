"""The message headers celery-baton stamps on a publish and reads back. Celery-free."""

from __future__ import annotations

#: The header that carries a call's per-call options (JSON, per_call.py).
CALL_HEADER = "baton_call"
#: The header that carries a superseding publish's order (supersede.py).
ORDER_HEADER = "baton_order"
#: The header the beat stamps on every message it sends: the slot it fires (epoch ms).
BEAT_SLOT_HEADER = "baton_beat_slot"
#: ... and the entry it fires.
BEAT_ENTRY_HEADER = "baton_beat_entry"
#: A scheduled slot's place in its entry's series: ``{"app": the app's schedule name,
#: "before": the entry's fired slot before this one (ms), or None}`` (slot_runs.py).
SERIES_HEADER = "baton_beat_series"
#: A scheduled beat slot's misfire policy, for a worker that held it past the grace:
#: ``{"misfire": "skip"|"latest"|"all", "grace": seconds, "next": the entry's next slot
#: (ms)}`` (worker/misfire.py).
MISFIRE_HEADER = "baton_beat_misfire"
#: The header that names one publish of a message (publish.py stamps it on every publish
#: path; a retry keeps its run's): a copy the broker redelivers carries the same value,
#: a new publish of the same task id (``Task.replace``, a frozen signature sent again,
#: ``apply_async(task_id=...)``) another. The redelivery guard refuses the first only.
PUBLISH_HEADER = "baton_publish"
