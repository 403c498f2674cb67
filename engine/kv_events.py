"""KV events: the engine side of the prefix-cache change feed that clients route by.

`KVEventLog` collects the routing keys (`shoal.engine.block_hash.routing_key`) of the blocks
the prefix cache gains and evicts, and seals them into numbered `KVCacheEvents` batches, one per
busy-loop turn; `with_kv_events` puts the batches on the frames every attached client receives.
The client side of the protocol (its state machine, snapshot and resync) is
`shoal.client.routing.kv_index`.

Protocol, engine side: batches are numbered 1, 2, ... with no gaps, and every attached client
receives every batch, in order, on its output connection. A batch that would carry more than
`max_keys` keys (a churning cache) is sent as an overflow marker without keys instead, which
makes every client resync from a snapshot: the feed's cost per turn is bounded. A snapshot
(`KVCacheSnapshot`, the utility call `get_kv_cache_snapshot`) first seals what is pending, so
it reflects exactly the batches up to its `seq`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from shoal.engine.protocol import EngineCoreOutputs, KVCacheEvents

# Keys one batch may carry before it becomes an overflow marker.
MAX_EVENT_KEYS = 4096


class KVEventLog:
    """Pending prefix-cache changes, and the batches sealed but not yet sent.

    Args:
        max_keys: keys one batch may carry (stored and removed together).
    """

    def __init__(self, max_keys: int = MAX_EVENT_KEYS) -> None:
        self.max_keys = max_keys
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._is_overflow = False
        self._seq = 0  # the last batch sealed
        self._sealed: list[KVCacheEvents] = []

    @property
    def seq(self) -> int:
        """The number of the last sealed batch (0: none yet)."""
        return self._seq

    def has_pending(self) -> bool:
        """Whether there are changes or sealed batches not yet taken."""
        return bool(self._stored or self._removed or self._is_overflow or self._sealed)

    def on_stored(self, key: int) -> None:
        """A block entered the prefix cache."""
        if not self._is_overflow:
            self._stored.append(key)
            self._check_size()

    def on_removed(self, key: int) -> None:
        """A block left the prefix cache (evicted or reset)."""
        if not self._is_overflow:
            self._removed.append(key)
            self._check_size()

    def seal(self) -> int:
        """Closes the pending changes into a batch, if there are any.

        Returns:
            the number of the last sealed batch.
        """
        if self._stored or self._removed or self._is_overflow:
            self._seq += 1
            if self._is_overflow:
                batch = KVCacheEvents(self._seq, is_overflow=True)
            else:
                batch = KVCacheEvents(self._seq, self._stored, self._removed)
            self._sealed.append(batch)
            self._stored, self._removed, self._is_overflow = [], [], False
        return self._seq

    def take(self) -> list[KVCacheEvents]:
        """Seals what is pending and hands over every sealed batch, oldest first."""
        self.seal()
        batches, self._sealed = self._sealed, []
        return batches

    def _check_size(self) -> None:
        if len(self._stored) + len(self._removed) > self.max_keys:
            self._stored, self._removed, self._is_overflow = [], [], True


def with_kv_events(
    outputs_by_client: Mapping[int, EngineCoreOutputs],
    batches: list[KVCacheEvents],
    clients: Collection[int],
    engine_index: int,
) -> list[tuple[int, EngineCoreOutputs]]:
    """The frames to send after a turn: each client's outputs, and every batch to every client.

    The last batch rides on a client's step outputs (a frame of its own if it has none); any
    earlier ones (a snapshot sealed mid-turn) go first, in frames of their own.

    Returns:
        (client index, frame) in sending order.
    """
    if not batches:
        return list(outputs_by_client.items())
    frames: list[tuple[int, EngineCoreOutputs]] = []
    for client_index in sorted({*clients, *outputs_by_client}):
        outputs = outputs_by_client.get(client_index)
        if client_index in clients:
            for batch in batches[:-1]:
                frame = EngineCoreOutputs(engine_index=engine_index, kv_events=batch)
                frames.append((client_index, frame))
            if outputs is None:
                outputs = EngineCoreOutputs(engine_index=engine_index)
            outputs.kv_events = batches[-1]
        if outputs is not None:
            frames.append((client_index, outputs))
    return frames
