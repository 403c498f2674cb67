"""`RequestRouter`: a DP client's request → rank table and its own view of every rank's load.

The `DPLBAsyncMPClient` owns one. It records which rank each in-flight request was sent to
(so aborts reach the owner, whatever policy chose the rank), and per rank a `RankLoad`: the
latest published stats with how many of this client's requests they include, and running sums
of this client's sends there that those stats miss. A load-balancing policy only reads
`RankLoad`s; every read is O(1), whatever the number of requests in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from shoal.engine.protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats


@dataclass
class InFlightRequest:
    """One of this client's requests on a rank, until it finishes or is aborted.

    With `request` kept (a client of a cluster that resizes), `token_ids` collects what the
    rank generated, so a rank that leaves can hand the request over: the same request, with
    these tokens as already generated (`EngineCoreRequest.resumed_output_token_ids`).
    """

    prompt_tokens: int
    seq: int  # this client's sends to the rank before this one
    has_output: bool = False
    request: EngineCoreRequest | None = None
    token_ids: list[int] = field(default_factory=list)
    # Whether the rank's `RankLoad.num_unseen` / `unseen_prompt_tokens` count this request.
    is_counted_unseen: bool = False
    # Prompt tokens the routing policy expected the rank to hold cached; None: not routed by
    # a policy (pinned, or handed over).
    predicted_hit_tokens: int | None = None
    # How often the request moved off a failed rank (`shoal.client.routing.migration`).
    num_migrations: int = 0
    # Its prompt's block keys the client's KV index expects at the rank until it starts
    # (`KVCacheIndex.expect`); None once settled, or when nothing was expected.
    expected_keys: list[int] | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with

    def resumed_request(self) -> EngineCoreRequest:
        """The request to send to another rank, continuing from where this one left it."""
        assert self.request is not None, "only a kept request can be handed over"
        resumed = [*self.request.resumed_output_token_ids, *self.token_ids]
        return msgspec.structs.replace(
            self.request, resumed_output_token_ids=resumed, data_parallel_rank=None
        )


@dataclass
class RankLoad:
    """What this client knows of one rank's load.

    `stats` were measured after the rank had taken in `requests_seen` of this client's
    requests (the engine counts each client's ADDs), so exactly the sends with `seq >=
    requests_seen` are missing from them. Of those, the ones with no output yet (once one has
    output, the engine's counts carry it) are "unseen": `num_unseen` of them, with
    `unseen_prompt_tokens` prompt tokens in all.

    The two sums are kept incrementally, so reading them costs O(1): a send adds to them; its
    first output, finish, abort or hand-over subtracts, once (`is_counted_unseen`); newer
    stats subtract the sends they now include, found at the front of `_pending`, which holds
    the counted sends in send order. Every send enters and leaves `_pending` once.
    """

    stats: SchedulerStats | None = None
    requests_seen: int = 0
    num_sent: int = 0
    in_flight: dict[str, InFlightRequest] = field(default_factory=dict)
    num_unseen: int = 0
    unseen_prompt_tokens: int = 0
    _pending: deque[InFlightRequest] = field(default_factory=deque)

    def add(self, request_id: str, entry: InFlightRequest) -> None:
        """Records a send to this rank (its `seq` is `num_sent`)."""
        self.in_flight[request_id] = entry
        self.num_sent += 1
        if entry.seq >= self.requests_seen:
            entry.is_counted_unseen = True
            self.num_unseen += 1
            self.unseen_prompt_tokens += entry.prompt_tokens
            self._pending.append(entry)

    def mark_seen(self, entry: InFlightRequest) -> None:
        """Stops counting a request as unseen (it produced output, finished or left)."""
        if entry.is_counted_unseen:
            entry.is_counted_unseen = False
            self.num_unseen -= 1
            self.unseen_prompt_tokens -= entry.prompt_tokens

    def holds_lora(self, name: str) -> bool:
        """Whether the rank holds (or is about to load) adapter `name`: in its live slots or
        wanted by its requests as its stats say, or sent there since those stats."""
        s = self.stats
        if s is not None and name in (*s.lora_live, *s.lora_running, *s.lora_waiting):
            return True
        return any(entry.lora_name == name for entry in self._pending)

    def is_lora_full(self) -> bool:
        """Whether every LoRA slot of the rank is taken, as its stats say: a new adapter there
        evicts one its requests may want again."""
        s = self.stats
        held = {*s.lora_live, *s.lora_running, *s.lora_waiting} if s is not None else set()
        return s is not None and 0 < s.max_loras <= len(held)

    def num_counted_by_stats(self) -> int:
        """This client's requests in flight here that `stats` count (sent before they were
        measured); the rest of the rank's requests in the stats are other clients'."""
        return sum(1 for entry in self.in_flight.values() if entry.seq < self.requests_seen)

    def update_stats(self, stats: SchedulerStats, requests_seen: int) -> bool:
        """Takes newer stats; returns False for older ones, which are ignored.

        Stats can arrive out of order (straight from the engine and through the
        coordinator): fewer steps, or as many steps and fewer requests seen, is older.
        """
        if self.stats is not None and (stats.step_counter, requests_seen) < (
            self.stats.step_counter,
            self.requests_seen,
        ):
            return False
        self.stats, self.requests_seen = stats, requests_seen
        pending = self._pending
        while pending and pending[0].seq < requests_seen:
            self.mark_seen(pending.popleft())
        return True


@dataclass
class RoutingStats:
    """Running totals of this client's routing, for metrics and `shoal status`.

    Predicted hits are what the policy expected the chosen rank to hold cached; actual ones
    what the engine reported with the request's first output (`num_cached_tokens`).
    """

    decisions: dict[str, int] = field(default_factory=dict)  # reason -> requests
    predicted_hit_tokens: int = 0
    actual_hit_tokens: int = 0
    # Requests moved to another rank, and requests lost, by reason (`shoal.client.routing.migration`).
    migrated: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    # Requests failed as poison instead of moved, by reason (`shoal.client.routing.migration`).
    poisoned: dict[str, int] = field(default_factory=dict)

    def on_decision(self, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1

    def on_migrated(self, reason: str) -> None:
        self.migrated[reason] = self.migrated.get(reason, 0) + 1

    def on_failed(self, reason: str) -> None:
        self.failed[reason] = self.failed.get(reason, 0) + 1

    def on_poisoned(self, reason: str) -> None:
        self.poisoned[reason] = self.poisoned.get(reason, 0) + 1


class RequestRouter:
    """Where this client's requests are, and each rank's load as this client sees it.

    Args:
        on_started: called once per request with `expected_keys`, with its rank and those
            keys, when it stops being unseen (first output, finish, abort or hand-over).
    """

    def __init__(self, on_started: Callable[[int, list[int]], None] | None = None) -> None:
        self.loads: dict[int, RankLoad] = {}
        self._rank_of: dict[str, int] = {}
        self.stats = RoutingStats()
        self._on_started = on_started

    def __len__(self) -> int:
        """The number of this client's requests in flight."""
        return len(self._rank_of)

    def rank_of(self, request_id: str) -> int | None:
        return self._rank_of.get(request_id)

    def request_ids(self) -> list[str]:
        """This client's requests in flight, oldest first."""
        return list(self._rank_of)

    def load(self, rank: int) -> RankLoad:
        load = self.loads.get(rank)
        if load is None:
            load = self.loads[rank] = RankLoad()
        return load

    def on_sent(
        self,
        request_id: str,
        rank: int,
        prompt_tokens: int,
        request: EngineCoreRequest | None = None,
        predicted_hit_tokens: int | None = None,
        num_migrations: int = 0,
        expected_keys: list[int] | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Records a send; keeps `request` (and from now on its tokens) if given."""
        load = self.load(rank)
        entry = InFlightRequest(prompt_tokens, load.num_sent, request=request, lora_name=lora_name)
        entry.predicted_hit_tokens = predicted_hit_tokens
        entry.num_migrations = num_migrations
        entry.expected_keys = expected_keys
        load.add(request_id, entry)
        self._rank_of[request_id] = rank

    def on_output(
        self,
        request_id: str,
        finished: bool,
        new_token_ids: Sequence[int] = (),
        num_cached_tokens: int = 0,
        from_rank: int | None = None,
    ) -> bool:
        """Takes one output of a request in flight.

        Returns:
            False for an output this client does not expect: of no request in flight, or,
            with `from_rank`, from a rank the request is not routed to (a failed rank's late
            word about a request that moved elsewhere); it is to be dropped.
        """
        rank = self._rank_of.get(request_id)
        if rank is None or (from_rank is not None and rank != from_rank):
            return False
        load = self.loads[rank]
        first = load.in_flight[request_id]
        if not first.has_output and first.predicted_hit_tokens is not None:
            self.stats.predicted_hit_tokens += first.predicted_hit_tokens
            self.stats.actual_hit_tokens += num_cached_tokens
        if finished:
            del self._rank_of[request_id]
            self._seen(rank, load, load.in_flight.pop(request_id))
        else:
            entry = load.in_flight[request_id]
            entry.has_output = True
            self._seen(rank, load, entry)
            if entry.request is not None:
                entry.token_ids.extend(new_token_ids)
        return True

    def on_outputs(
        self, outputs: list[EngineCoreOutput], rank: int
    ) -> list[EngineCoreOutput] | None:
        """Takes one frame of outputs from `rank` (`on_output` each).

        Returns:
            None when every output is expected; else the expected ones, to replace the frame's
            (the others are of requests not routed to `rank`, to be dropped).
        """
        kept: list[EngineCoreOutput] | None = None  # made only once one is dropped
        for i, output in enumerate(outputs):
            if self.on_output(
                output.request_id,
                output.finished,
                output.new_token_ids,
                output.num_cached_tokens,
                rank,
            ):
                if kept is not None:
                    kept.append(output)
            elif kept is None:
                kept = outputs[:i]
        return kept

    def take(self, request_id: str, rank: int) -> InFlightRequest | None:
        """Forgets a request that `rank` released (to send it elsewhere); None if it is not
        in flight there (it finished, or was aborted, meanwhile)."""
        if self._rank_of.get(request_id) != rank:
            return None
        del self._rank_of[request_id]
        load = self.loads[rank]
        entry = load.in_flight.pop(request_id)
        self._seen(rank, load, entry)
        return entry

    def on_aborted(self, request_ids: Sequence[str]) -> dict[int, list[str]]:
        """Forgets aborted requests; returns those that were in flight, by rank."""
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._rank_of.pop(request_id, None)
            if rank is not None:
                load = self.loads[rank]
                self._seen(rank, load, load.in_flight.pop(request_id))
                by_rank.setdefault(rank, []).append(request_id)
        return by_rank

    def take_rank(self, rank: int) -> dict[str, InFlightRequest]:
        """Forgets every request on a rank (a failed one); returns them, oldest first, to be
        sent elsewhere. The rank's load view stays until `forget_rank`."""
        load = self.loads.get(rank)
        if load is None:
            return {}
        taken, load.in_flight = load.in_flight, {}
        for request_id, entry in taken.items():
            del self._rank_of[request_id]
            self._seen(rank, load, entry)
        return taken

    def forget_rank(self, rank: int) -> list[str]:
        """Drops a rank (dead or removed); returns this client's requests that were on it.

        A rank that comes back is a new engine: its count of this client's sends starts over.
        """
        load = self.loads.pop(rank, None)
        if load is None:
            return []
        for request_id in load.in_flight:
            del self._rank_of[request_id]
        return list(load.in_flight)

    def _seen(self, rank: int, load: RankLoad, entry: InFlightRequest) -> None:
        """The request started, ended or left `rank`: its load counts as the rank's own, and
        its expected blocks are settled."""
        load.mark_seen(entry)
        if entry.expected_keys is not None:
            keys, entry.expected_keys = entry.expected_keys, None
            if self._on_started is not None:
                self._on_started(rank, keys)
