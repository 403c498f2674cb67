"""`KVCacheIndex`: every rank's prefix cache as this client knows it, from the engines' KV events.

Each front end keeps one, fed on its own output connections, so every front end holds the same
exact view and routes alike. For each rank it holds the set of cached blocks' routing keys
(`shoal.engine.block_hash.routing_key`); a prompt's chain of keys is matched against all ranks
at once in O(ranks + prompt blocks), with one bit per rank in a map key -> ranks. The engine
side of the feed is `shoal.engine.kv_events`.

Protocol, one state machine per rank (engine incarnation):

    UNSYNCED --need_snapshot()--> SYNCING --apply_snapshot(seq=S)--> LIVE(expect S+1)
       ^                           |  batches arriving meanwhile are buffered (at most
       |                           |  MAX_BUFFERED_BATCHES, oldest dropped), then replayed
       |                           |  past S; a hole among them -> UNSYNCED
       +--- LIVE: a batch with seq > expected (a gap), or an overflow marker, drops the
            rank's keys (it routes as if nothing were cached there) and goes UNSYNCED.
            A batch with seq < expected is already in the view and is ignored.

While UNSYNCED a rank's batches are dropped, each one a reminder to fetch the snapshot. A rank
that attaches starts UNSYNCED with no keys; the client asks it for a snapshot at once
(`get_kv_cache_snapshot`), and again on a failed fetch at the next batch or routing. A rank
that dies or leaves is dropped with all its keys; one that comes back is a new incarnation and
starts over.

Expected blocks. Between sending a prompt to a rank and that rank's first output for it, the
events cannot yet show the prompt's blocks: a second prompt with the same prefix, routed in
that window, would find it cached nowhere and go wherever load says, and both ranks would
compute (and then hold) the same document. So this client also counts, per rank, the blocks
of its own prompts in flight there that have produced no output yet (`expect` when sent,
`settle` at the first output, finish, abort or hand-over; the events then carry what the
rank really kept). `match` counts a block as held where it is cached or expected. Expected
blocks are this front end's own, so two front ends agree exactly once their prompts in flight
have started.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shoal.engine.protocol import KVCacheEvents, KVCacheSnapshot

# Batches a rank may send while its snapshot is on the way before the oldest are dropped.
MAX_BUFFERED_BATCHES = 256


class SyncState(enum.Enum):
    UNSYNCED = "unsynced"
    SYNCING = "syncing"
    LIVE = "live"


@dataclass
class RankCacheView:
    """One rank's cached blocks and where its KV-event feed stands."""

    bit: int
    state: SyncState = SyncState.UNSYNCED
    next_seq: int = 1  # LIVE: the batch expected next
    keys: set[int] = field(default_factory=set)
    buffered: deque[KVCacheEvents] = field(
        default_factory=lambda: deque(maxlen=MAX_BUFFERED_BATCHES)
    )
    num_resyncs: int = 0  # snapshots taken after the first (gaps and overflows)
    # Blocks of this client's prompts sent here and not started yet: key -> how many prompts.
    expected: dict[int, int] = field(default_factory=dict)


class KVCacheIndex:
    """Per rank, which blocks its prefix cache holds; matches prompts against all ranks.

    Args:
        block_size: tokens per block of the engines (all ranks of a cluster share it).
    """

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size
        self.views: dict[int, RankCacheView] = {}
        self._ranks_of: dict[int, int] = {}  # routing key -> bit mask of the ranks holding it
        self._expected_at: dict[int, int] = {}  # routing key -> bit mask of ranks expecting it
        self._next_bit = 0

    def add_rank(self, rank: int, block_size: int) -> None:
        """Starts a rank (a new incarnation) empty and UNSYNCED."""
        self.drop_rank(rank)
        if not self.block_size:
            self.block_size = block_size
        self.views[rank] = RankCacheView(bit=1 << self._take_bit())

    def drop_rank(self, rank: int) -> None:
        """Forgets a rank and every key it held (dead, removed, or attached anew)."""
        view = self.views.pop(rank, None)
        if view is not None:
            self._clear(view)
            self._unexpect(view, list(view.expected), all_of_them=True)

    def need_snapshot(self, rank: int) -> bool:
        """Whether `rank` is UNSYNCED; if so it becomes SYNCING and the caller must fetch a
        snapshot and hand it to `apply_snapshot` (or `snapshot_failed`)."""
        view = self.views.get(rank)
        if view is None or view.state is not SyncState.UNSYNCED:
            return False
        view.state = SyncState.SYNCING
        view.buffered.clear()
        return True

    def snapshot_failed(self, rank: int) -> None:
        """The snapshot did not come: the rank is UNSYNCED again."""
        view = self.views.get(rank)
        if view is not None and view.state is SyncState.SYNCING:
            view.state = SyncState.UNSYNCED

    def apply_snapshot(self, rank: int, snapshot: KVCacheSnapshot) -> bool:
        """Replaces a SYNCING rank's keys with a snapshot and replays the batches after it.

        Returns:
            True when the replay found a hole (batches dropped from a full buffer): the rank
            is UNSYNCED again and needs another snapshot.
        """
        view = self.views.get(rank)
        if view is None or view.state is not SyncState.SYNCING:
            return False  # the rank left, or came back as a new incarnation, meanwhile
        buffered = list(view.buffered)
        self._clear(view)
        self._add_keys(view, snapshot.block_keys)
        view.state, view.next_seq = SyncState.LIVE, snapshot.seq + 1
        return any([self.apply_events(rank, batch) for batch in buffered])

    def apply_events(self, rank: int, batch: KVCacheEvents) -> bool:
        """Applies one batch of a rank's feed.

        Returns:
            True when the rank became UNSYNCED (a gap or an overflow): the caller should
            fetch a snapshot (`need_snapshot`).
        """
        view = self.views.get(rank)
        if view is None or view.state is SyncState.UNSYNCED:
            return view is not None
        if view.state is SyncState.SYNCING:
            view.buffered.append(batch)
            return False
        if batch.seq < view.next_seq:
            return False
        if batch.seq > view.next_seq or batch.is_overflow:
            self._clear(view)
            view.state = SyncState.UNSYNCED
            view.num_resyncs += 1
            return True
        self._add_keys(view, batch.stored)
        self._remove_keys(view, batch.removed)
        view.next_seq += 1
        return False

    def expect(self, rank: int, keys: Sequence[int]) -> None:
        """A prompt with these block keys was sent to `rank` (see "Expected blocks")."""
        view = self.views.get(rank)
        if view is None:
            return
        expected, expected_at = view.expected, self._expected_at
        for key in keys:
            count = expected.get(key, 0)
            expected[key] = count + 1
            if not count:
                expected_at[key] = expected_at.get(key, 0) | view.bit

    def settle(self, rank: int, keys: Sequence[int]) -> None:
        """A prompt `expect`ed at `rank` started (or ended, or left): its keys count no more."""
        view = self.views.get(rank)
        if view is not None:
            self._unexpect(view, keys)

    def match(self, keys: Sequence[int], ranks: Iterable[int]) -> dict[int, int]:
        """How many leading blocks of a prompt's chain of `keys` each of `ranks` holds or is
        expected to hold (see "Expected blocks").

        O(len(ranks) + matched blocks): every rank's bit is tested against each key at once.
        """
        bits = {rank: view.bit for rank in ranks if (view := self.views.get(rank)) is not None}
        matched = dict.fromkeys(ranks, 0)
        alive = 0
        for bit in bits.values():
            alive |= bit
        num_blocks = 0
        ranks_of, expected_at = self._ranks_of, self._expected_at
        for key in keys:
            still = alive & (ranks_of.get(key, 0) | expected_at.get(key, 0))
            if still != alive:
                for rank, bit in bits.items():
                    if alive & bit and not still & bit:
                        matched[rank] = num_blocks
            alive = still
            if not alive:
                break
            num_blocks += 1
        for rank, bit in bits.items():
            if alive & bit:
                matched[rank] = num_blocks
        return matched

    @property
    def num_keys(self) -> int:
        """Distinct blocks cached or expected on any rank (0: no prompt can match; skip
        hashing it)."""
        return len(self._ranks_of) + len(self._expected_at)

    def unsynced(self, ranks: Iterable[int]) -> list[int]:
        """Those of `ranks` that are UNSYNCED (their view waits for a snapshot request)."""
        views = self.views
        return [
            r for r in ranks if (v := views.get(r)) is not None and v.state is SyncState.UNSYNCED
        ]

    def num_cached_blocks(self, rank: int) -> int:
        view = self.views.get(rank)
        return 0 if view is None else len(view.keys)

    def _take_bit(self) -> int:
        used = {view.bit for view in self.views.values()}
        while 1 << self._next_bit in used:
            self._next_bit += 1
        bit, self._next_bit = self._next_bit, 0
        return bit

    def _add_keys(self, view: RankCacheView, keys: Iterable[int]) -> None:
        ranks_of = self._ranks_of
        for key in keys:
            if key not in view.keys:
                view.keys.add(key)
                ranks_of[key] = ranks_of.get(key, 0) | view.bit

    def _remove_keys(self, view: RankCacheView, keys: Iterable[int]) -> None:
        ranks_of = self._ranks_of
        for key in keys:
            if key in view.keys:
                view.keys.discard(key)
                mask = ranks_of[key] & ~view.bit
                if mask:
                    ranks_of[key] = mask
                else:
                    del ranks_of[key]

    def _unexpect(
        self, view: RankCacheView, keys: Sequence[int], *, all_of_them: bool = False
    ) -> None:
        expected, expected_at = view.expected, self._expected_at
        for key in keys:
            count = expected.get(key, 0) - 1
            if count > 0 and not all_of_them:
                expected[key] = count
            elif key in expected:
                del expected[key]
                mask = expected_at[key] & ~view.bit
                if mask:
                    expected_at[key] = mask
                else:
                    del expected_at[key]

    def _clear(self, view: RankCacheView) -> None:
        self._remove_keys(view, list(view.keys))
        view.buffered.clear()
