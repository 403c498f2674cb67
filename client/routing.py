"""`RequestRouter`: a DP client's request → rank table and its own view of every rank's load.

The `DPLBAsyncMPClient` owns one. It records which rank each in-flight request was sent to
(so aborts reach the owner, whatever policy chose the rank), and per rank a `RankLoad`: the
latest published stats with how many of this client's requests they include, and this
client's own sends there. A load-balancing policy only reads `RankLoad`s and scores them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from shoal.engine.protocol import EngineCoreRequest, SchedulerStats


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
    requests_seen` are missing from them.
    """

    stats: SchedulerStats | None = None
    requests_seen: int = 0
    num_sent: int = 0
    in_flight: dict[str, InFlightRequest] = field(default_factory=dict)

    def unseen(self) -> Iterator[InFlightRequest]:
        """This client's requests that the published stats do not include yet and that have
        produced no output (once one has, the engine's counts carry it)."""
        seen = self.requests_seen
        return (e for e in self.in_flight.values() if e.seq >= seen and not e.has_output)

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
        return True


class RequestRouter:
    """Where this client's requests are, and each rank's load as this client sees it."""

    def __init__(self) -> None:
        self.loads: dict[int, RankLoad] = {}
        self._rank_of: dict[str, int] = {}

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
    ) -> None:
        """Records a send; keeps `request` (and from now on its tokens) if given."""
        load = self.load(rank)
        load.in_flight[request_id] = InFlightRequest(prompt_tokens, load.num_sent, request=request)
        load.num_sent += 1
        self._rank_of[request_id] = rank

    def on_output(self, request_id: str, finished: bool, new_token_ids: Sequence[int] = ()) -> None:
        rank = self._rank_of.get(request_id)
        if rank is None:
            return
        in_flight = self.loads[rank].in_flight
        if finished:
            del self._rank_of[request_id]
            del in_flight[request_id]
        else:
            entry = in_flight[request_id]
            entry.has_output = True
            if entry.request is not None:
                entry.token_ids.extend(new_token_ids)

    def take(self, request_id: str, rank: int) -> InFlightRequest | None:
        """Forgets a request that `rank` released (to send it elsewhere); None if it is not
        in flight there (it finished, or was aborted, meanwhile)."""
        if self._rank_of.get(request_id) != rank:
            return None
        del self._rank_of[request_id]
        return self.loads[rank].in_flight.pop(request_id)

    def on_aborted(self, request_ids: Sequence[str]) -> dict[int, list[str]]:
        """Forgets aborted requests; returns those that were in flight, by rank."""
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._rank_of.pop(request_id, None)
            if rank is not None:
                del self.loads[rank].in_flight[request_id]
                by_rank.setdefault(rank, []).append(request_id)
        return by_rank

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
