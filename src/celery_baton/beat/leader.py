"""The beat leader lease: taken, renewed every ttl/3, lost, resigned; and the clock.

Every beat calls ``beat_lead`` each ttl/3; one holds the lease (ttl
``baton_beat_lease_ttl``) and only it fires, under the lease's fence. Each reply also
carries the store server's time: "now" is that time advanced with the monotonic clock
in between, so all beats agree, and a jump of the host's wall clock causes neither a
burst nor a stall.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from celery.utils.log import get_logger

from celery_baton import metrics
from celery_baton.beat.state import BeatState, LeadReply

logger = get_logger(__name__)


class Leader:
    """This process's view of the leader lease of one app's schedule.

    ``clock`` (epoch milliseconds) replaces the store's clock: for tests only. The
    store state is attached once the store is connected (``attach``).
    """

    def __init__(self, owner: str, ttl: float, clock: Callable[[], int] | None = None) -> None:
        self.owner = owner
        self.ttl = ttl
        self.state: BeatState | None = None
        self.leading = False
        self.fence = 0
        self.renew_at = 0.0  # monotonic: when to call beat_lead next
        self.lease_until = 0.0  # monotonic: when the lease held may have ended
        self._clock = clock
        self._anchor: tuple[int, float] | None = None  # (server ms, monotonic) of a reply
        self._standing_by_for: str | None = None
        self._store_error_logged = 0.0

    def attach(self, state: BeatState) -> None:
        self.state = state

    def now_ms(self) -> int:
        """Now, in epoch milliseconds, by the store's clock (or the injected one)."""
        if self._clock is not None:
            return int(self._clock())
        if self._anchor is None:
            return int(time.time() * 1000)
        server_ms, mono = self._anchor
        return server_ms + int((time.monotonic() - mono) * 1000)

    def due(self, mono: float) -> bool:
        """Whether the lease is to be renewed (or taken) now; drops a lease that ran out
        without a renewal (the store did not answer)."""
        if mono >= self.renew_at:
            return True
        if self.leading and mono > self.lease_until:
            self.leading = False
        return False

    def renew(self, mono: float) -> tuple[LeadReply, bool]:
        """Take or renew the lease (``mono``: the monotonic time before the call); the
        store's reply and whether this process began to lead (or leads under a new
        fence): its copy of the schedule is then to be read again in full."""
        assert self.state is not None
        reply = self.state.lead(self.owner, int(self.ttl * 1000))
        after = time.monotonic()
        self._anchor = (reply.server_ms, (mono + after) / 2)
        self.renew_at = mono + self.ttl / 3
        new_term = False
        if reply.leading:
            if not self.leading or reply.fence != self.fence:
                # Who leads, named as the other beats' "standing by" lines and
                # `celery baton schedule` name it (host:pid:id).
                logger.info("beat: leading the schedule (fence %s) as %s", reply.fence, self.owner)
                metrics.beat_leader_changes.inc()
                new_term = True
            self.leading = True
            self.fence = reply.fence
            # Measured from before the call: the server's lease may have started then.
            self.lease_until = mono + self.ttl
        else:
            if self.leading:
                logger.warning("beat: lost the leader lease to %s", reply.holder)
            elif reply.holder != self._standing_by_for:
                logger.info("beat: standing by; %s leads", reply.holder or "nobody yet")
            self._standing_by_for = reply.holder
            self.leading = False
        return reply, new_term

    def lost(self) -> None:
        """The store refused a write under this fence: another beat leads."""
        self.leading = False

    def wait(self) -> float:
        """Seconds until the next renewal (a follower's sleep)."""
        return max(self.renew_at - time.monotonic(), 0.05)

    def store_failed(self, exc: BaseException) -> None:
        """The store did not answer: ask again within 1 s; lead no longer than the lease
        held may have lasted."""
        mono = time.monotonic()
        if mono - self._store_error_logged > 10:
            logger.warning("beat: store unavailable, firing nothing until it is back: %r", exc)
            self._store_error_logged = mono
        self.renew_at = min(self.renew_at, mono + 1.0)
        if self.leading and mono > self.lease_until:
            self.leading = False

    def resign(self) -> None:
        """Give the lease up at once (SIGTERM), so a follower leads on its next poll."""
        try:
            if self.leading and self.state is not None:
                self.state.resign(self.owner)
                logger.info("beat: resigned the leader lease (fence %s)", self.fence)
        finally:
            self.leading = False
