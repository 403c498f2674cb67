"""`RendezvousServer`: the TCPStore where an expert-parallel cluster's ranks form their groups.

The registry hosts one per cluster and hands its address to every rank that starts (again
after each restart); the ranks keep their generations and wake keys in it
(`shoal.engine.parallel.distributed`, `shoal.engine.parallel.dp_wave`). It lives as long as the registry: a
registry that Ray restarts serves a new store, and ranks that lose the old one restart too.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import TCPStore

_STORE_TIMEOUT_S = 300.0


class RendezvousServer:
    """A TCPStore server bound to one address (loopback stays loopback).

    Args:
        host: the address to listen on.
    """

    def __init__(self, host: str) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(256)
        self.host = host
        self.port: int = listener.getsockname()[1]
        # The store owns the bound socket from now on (TCPStore binds every interface
        # when it opens its own).
        self._store = TCPStore(
            host,
            self.port,
            None,
            True,
            timedelta(seconds=_STORE_TIMEOUT_S),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            use_libuv=False,
        )

    def set(self, key: str, value: str) -> None:
        """Writes one key (e.g. the abort key of a resize's groups)."""
        self._store.set(key, value)

    def address(self) -> tuple[str, int]:
        return self.host, self.port
