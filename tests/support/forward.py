"""A TCP forwarder: a server on this machine, reached at another of its addresses.

A broker on "another machine" without a network: :class:`Forward` listens on an address
of this machine that is not a loopback one and passes every connection through to the
real server on 127.0.0.1. A client given that address sees a broker it can reach whose
host is not this one by name, as a worker on a second machine would.

Example::

    with Forward(5672) as fwd:        # RabbitMQ on 127.0.0.1:5672
        url = f"amqp://guest:guest@{fwd.host}:{fwd.port}//"
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

import psutil


def outside_address() -> str | None:
    """An IPv4 address of this machine that is not a loopback one (None: none here)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


class Forward:
    """Listens on ``host`` (default :func:`outside_address`), forwards to 127.0.0.1:``port``."""

    def __init__(self, port: int, host: str | None = None) -> None:
        self.target = ("127.0.0.1", port)
        chosen = host or outside_address()
        if chosen is None:
            raise OSError("this machine has no address but loopback ones")
        self._listener = socket.create_server((chosen, 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept, name="forward", daemon=True).start()

    def __enter__(self) -> Forward:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either side ends; then end both (the other pump
    wakes up) and close ``src`` (the other pump closes ``dst``)."""
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    src.close()
