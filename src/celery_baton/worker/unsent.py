"""Unsent releases: what the store did not confirm is sent again once it answers.

A release the store did not answer (a timeout, a broken connection) is kept until the
store answers something (an ask, a release, or the PING sent every second meanwhile)
and then sent again: never ahead of a call the store had buffered, which is what makes
the give-back of a lost ask safe (``Releasing.give_back_lost``). On the consumer's loop
the waiting releases ride the pipelined channel; off it (solo and threads pools, the ack
fates' thread), and at shutdown, the lease book's thread retries them instead.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from celery_baton.core.gate import Release
from celery_baton.core.gate_channel import GateChannel
from celery_baton.core.leases import LeaseBook

logger = logging.getLogger("celery_baton.worker")

PROBE_INTERVAL = 1.0  # seconds between PINGs while releases wait for the store


class UnsentReleases:
    """Releases waiting for the store to answer again.

    Built before the gate channel it sends through (the channel reports failed releases
    and answers to it): :meth:`attach` completes it."""

    def __init__(self, book: LeaseBook, timer: Any) -> None:
        self.book = book
        self.timer = timer
        self.channel: GateChannel
        self._waiting: list[Release] = []
        self._probe_armed = False
        self._loop_thread = threading.get_ident()  # consumers are built on their loop

    def attach(self, channel: GateChannel) -> None:
        self.channel = channel

    def add(self, release: Release) -> None:
        """A release the store did not confirm: send it once the store answers."""
        if self.channel.pipelined and threading.get_ident() == self._loop_thread:
            self._waiting.append(release)
            self._arm_probe()
            return
        gate = self.channel.gate

        def send() -> None:
            # A reply to PING shows the store runs again and has read what it was sent
            # before; the release then arrives after a lost call.
            try:
                gate.store.client.ping()
            except Exception as exc:
                raise gate.store.unavailable(exc) from exc
            gate.release_many([release])

        self.book.retry_later(send, release.lease_keys)

    def store_answered(self) -> None:
        """The store answered: send the releases that waited for it."""
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            for release in waiting:
                self.channel.release(release)  # failing again: back in here

    def restart(self, timer: Any) -> None:
        """The consumer restarted (a lost broker connection): its timers were reset."""
        self.timer = timer
        self._loop_thread = threading.get_ident()
        self._probe_armed = False
        if self._waiting:
            self._arm_probe()

    def hand_over(self) -> None:
        """At shutdown: what still waits goes to the lease book, which sends it
        (blocking, from the shutdown) before it stops."""
        waiting, self._waiting = self._waiting, []
        gate = self.channel.gate
        for release in waiting:
            self.book.retry_later(
                functools.partial(gate.release_many, [release]), release.lease_keys
            )

    def _arm_probe(self) -> None:
        if not self._probe_armed:
            self._probe_armed = True
            self.timer.call_after(PROBE_INTERVAL, self._probe, priority=5)

    def _probe(self) -> None:
        # kombu's timer swallows exceptions: catch everything so no release is lost.
        try:
            self._probe_armed = False
            if self._waiting:
                self.channel.ping(self._probed)
        except Exception:
            logger.exception("baton: probing the store failed; trying again")
            self._arm_probe()

    def _probed(self, reply: Any) -> None:
        if isinstance(reply, BaseException):
            self._arm_probe()
        else:
            self.store_answered()
