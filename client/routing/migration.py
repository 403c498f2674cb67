"""`RequestMigrator`: moves a DP client's in-flight requests off a rank that failed or left.

A request moves as the same `EngineCoreRequest` with the tokens its caller has already
received appended to `resumed_output_token_ids`; the new rank prefills prompt + those tokens
and emits only what it samples after them, so the caller's stream goes on with no token
missing or repeated. The moves, in the order the client sees things:

1. The output task learns a rank died or hung (a death notice, the engine monitor, or the
   rank letting this client go), or the cluster link removes a rank the registry found dead
   first, and before any consumer runs the client calls `on_rank_failed`: the
   rank's entries leave the router at once, so every output the failed incarnation still
   sends for them is dropped (`DPLBAsyncMPClient.process_engine_outputs` keeps only outputs
   from the rank a request is routed to).
2. Each request that may move (not pinned to the rank with `data_parallel_rank`, fewer than
   `max_migrations` moves so far) is "moving" (`is_moving`) until a side task has sent it
   through the normal routing policy, which no longer sees the failed rank. With no rank
   routable (every rank failed: an expert-parallel wave that ended, say) the moving requests
   are held until a rank serves again, up to `MIGRATION_WAIT_S`.
3. A request that may not move, or that no rank took, is failed with `RequestsLostError`
   (an `EngineDeadError`), exactly as every request of a failed rank is with the limit at 0.

Poison requests are never moved: a request that may itself be what killed its rank would
kill the next one too. At step 2 a request is failed instead, with `PoisonRequestError`
(counted in `RoutingStats.poisoned`, `shoal:poison_requests_total{reason}`), when:

- "intake": its rank died while taking it in. A rank takes in one client's requests in the
  order they were sent (checks, grammar compile, queueing) and only afterwards reports how
  many it has taken in (`RankLoad.requests_seen`, with its outputs and stats reports). Of
  intake's steps only the grammar compile runs native code on what a user wrote, so only a
  request with structured outputs is suspected: of those the rank had not reported taken in,
  and that had no output, the oldest is the one it was compiling when it died, if it died
  compiling. A rank that died of something else just after such a request was sent to it
  fails that one request this way too (the client cannot tell the two apart); a plain
  request is never failed for its rank's death at intake, and moves.
- "rank_deaths": it was running (it had output) on `MAX_RANK_DEATHS` (2) ranks as they died.

A rank that leaves in a resize releases its requests (`on_rank_released`): they move the same
way, without counting against the limit. The migrator owns only the moving requests and the
counts; the client owns the router and the sockets and is passed in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from shoal.client.routing.router import InFlightRequest
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason

if TYPE_CHECKING:
    from shoal.client.routing.lb_client import DPLBAsyncMPClient

logger = logging.getLogger(__name__)

# vLLM's `--migration-limit` default is 0; here moving is on by default: it loses nothing.
DEFAULT_MIGRATION_LIMIT = 3

# How long moving requests are held for a rank to serve when none does (ranks re-forming).
MIGRATION_WAIT_S = 60.0
_WAIT_POLL_S = 0.05

# The `reason` label of `shoal:requests_migrated_total` / `shoal:requests_failed_total`.
REASON_RANK_FAILED = "rank_failed"  # died, hung, or let this client go
REASON_RESIZE = "resize"  # left the cluster in a scale-down
REASON_LIMIT = "migration_limit"  # moved `max_migrations` times already (or the limit is 0)
REASON_PINNED = "pinned"  # pinned to the failed rank by `data_parallel_rank`
REASON_NO_RANK = "no_rank"  # no rank took it within the bound
MIGRATED_REASONS = (REASON_RANK_FAILED, REASON_RESIZE)
FAILED_REASONS = (REASON_LIMIT, REASON_PINNED, REASON_NO_RANK, REASON_RESIZE)

# The `reason` label of `shoal:poison_requests_total`.
POISON_INTAKE = "intake"  # its rank died while taking it in
POISON_RANK_DEATHS = "rank_deaths"  # it was running on `MAX_RANK_DEATHS` ranks as they died
POISON_REASONS = (POISON_INTAKE, POISON_RANK_DEATHS)
# A request running on this many ranks as they died is not moved again.
MAX_RANK_DEATHS = 2


class RequestsLostError(EngineDeadError):
    """These requests of a failed rank could not move to another rank; they are lost.

    Args:
        request_ids: the engine request ids lost.
        message: why.
        engine_index: the rank they were on.
    """

    def __init__(self, request_ids: list[str], message: str, *, engine_index: int) -> None:
        self.request_ids = request_ids
        super().__init__(message, engine_index=engine_index)


class PoisonRequestError(RequestsLostError):
    """These requests may be what killed their rank; they are not sent to another one."""


class RequestMigrator:
    """The moving requests of one `DPLBAsyncMPClient`; it counts moves and losses in the
    client's `RoutingStats` (`migrated`, `failed`, by reason).

    Args:
        max_migrations: how often one request may move after a failure; 0: never (each
            request of a failed rank fails with `EngineDeadError`).

    Raises:
        ValueError: a negative limit.
    """

    def __init__(self, max_migrations: int = DEFAULT_MIGRATION_LIMIT) -> None:
        if max_migrations < 0:
            raise ValueError(f"the migration limit must be >= 0, not {max_migrations}")
        self.max_migrations = max_migrations
        self._moving: dict[str, InFlightRequest] = {}
        # Request id -> ranks that died while it ran there, for requests that moved on.
        self._rank_deaths: dict[str, int] = {}

    def is_moving(self, request_id: str) -> bool:
        """Whether a request left a failed rank and is not on another one yet."""
        return request_id in self._moving

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drops aborted requests: a moving one is not sent anywhere."""
        for request_id in request_ids:
            self._moving.pop(request_id, None)

    def on_rank_failed(self, client: DPLBAsyncMPClient, rank: int) -> None:
        """Takes a failed rank's requests off it and moves those that may move (a side task).

        Called before any consumer hears of the failure (by the output task for a death, by
        the cluster link's removal of a rank the registry no longer lists): the consumer then
        fails only requests neither routed elsewhere nor moving. Outside the event loop (a
        client closing) nothing moves.
        """
        self._forget_finished(client)
        load = client.router.loads.get(rank)
        num_taken_in = load.requests_seen if load is not None else 0
        entries = client.router.take_rank(rank)
        if not entries:
            return
        try:
            asyncio.get_running_loop()
            can_move = not client.is_closed
        except RuntimeError:  # removed outside the event loop (the client is closing)
            can_move = False
        taking_in = _being_taken_in(entries, num_taken_in)
        movable: list[tuple[str, InFlightRequest]] = []
        lost: dict[str, list[str]] = {}
        for request_id, entry in entries.items():
            request = entry.request
            reason = self._poison_reason(request_id, entry, taking_in)
            if reason is not None:
                self._poison(client, rank, request_id, reason)
            elif request is None or entry.num_migrations >= self.max_migrations:
                lost.setdefault(REASON_LIMIT, []).append(request_id)
            elif request.data_parallel_rank is not None:
                lost.setdefault(REASON_PINNED, []).append(request_id)
            elif not can_move:
                lost.setdefault(REASON_NO_RANK, []).append(request_id)
            else:
                self._moving[request_id] = entry
                movable.append((request_id, entry))
        for reason, request_ids in lost.items():
            self._fail(client, rank, request_ids, reason)
        if movable:
            side_tasks = client.resources.side_tasks  # cancelled when the client closes
            task = asyncio.create_task(self._move(client, rank, movable), name=f"Migrate{rank}")
            side_tasks.add(task)
            task.add_done_callback(side_tasks.discard)

    async def on_rank_released(
        self, client: DPLBAsyncMPClient, rank: int, request_ids: list[str]
    ) -> None:
        """Hands each request a leaving rank released to another rank, with the tokens it has
        so far; one that cannot be placed finishes with an error output."""
        for request_id in request_ids:
            entry = client.router.take(request_id, rank)
            if entry is None:
                continue  # finished or aborted meanwhile
            try:
                await client.add_request_async(entry.resumed_request())
            except (EngineDeadError, RequestError) as e:
                client.router.stats.on_failed(REASON_RESIZE)
                failed = EngineCoreOutput(
                    request_id,
                    finish_reason=FinishReason.ERROR,
                    error_message=f"its rank left the cluster and no other rank took it: {e}",
                )
                client.outputs_queue.put_nowait(
                    EngineCoreOutputs(engine_index=rank, outputs=[failed])
                )
                continue
            client.router.stats.on_migrated(REASON_RESIZE)
            self._log_move(client, request_id, rank, entry, REASON_RESIZE)

    async def _move(
        self, client: DPLBAsyncMPClient, rank: int, movable: list[tuple[str, InFlightRequest]]
    ) -> None:
        """Sends each moving request through the client's routing, oldest first, once a rank
        serves (within `MIGRATION_WAIT_S`)."""
        await _until_a_rank_serves(client, MIGRATION_WAIT_S)
        lost: list[str] = []
        for request_id, entry in movable:
            if request_id not in self._moving:
                continue  # aborted meanwhile
            resumed = entry.resumed_request()
            try:
                await client.add_request_async(resumed, num_migrations=entry.num_migrations + 1)
            except (EngineDeadError, RequestError) as e:
                if self._moving.pop(request_id, None) is not None:
                    logger.warning("request %s could not leave rank %d: %s", request_id, rank, e)
                    lost.append(request_id)
                continue
            if self._moving.pop(request_id, None) is None:
                # Aborted while it was being sent: abort it where it went.
                await client.abort_requests_async([request_id])
                continue
            client.router.stats.on_migrated(REASON_RANK_FAILED)
            self._log_move(client, request_id, rank, entry, REASON_RANK_FAILED)
        if lost:
            self._fail(client, rank, lost, REASON_NO_RANK)

    def _poison_reason(
        self, request_id: str, entry: InFlightRequest, taking_in: str | None
    ) -> str | None:
        """Why a failed rank's request is poison (counting this death), or None."""
        if request_id == taking_in:
            return POISON_INTAKE
        if not entry.has_output:
            return None
        deaths = self._rank_deaths.get(request_id, 0) + 1
        if deaths >= MAX_RANK_DEATHS:
            self._rank_deaths.pop(request_id, None)
            return POISON_RANK_DEATHS
        self._rank_deaths[request_id] = deaths
        return None

    def _poison(self, client: DPLBAsyncMPClient, rank: int, request_id: str, reason: str) -> None:
        client.router.stats.on_poisoned(reason)
        if reason == POISON_INTAKE:
            why = f"rank {rank} died while taking it in"
        else:
            why = f"it was running on {MAX_RANK_DEATHS} ranks as they died (the last, rank {rank})"
        logger.warning("request %s is not moved to another rank: %s", request_id, why)
        message = f"this request may crash the engine: {why}; it is not sent to another rank"
        client.outputs_queue.put_nowait(
            PoisonRequestError([request_id], message, engine_index=rank)
        )

    def _forget_finished(self, client: DPLBAsyncMPClient) -> None:
        """Drops the death counts of requests that finished since (a rare path: a failure)."""
        for request_id in list(self._rank_deaths):
            if client.router.rank_of(request_id) is None and request_id not in self._moving:
                del self._rank_deaths[request_id]

    def _fail(self, client: DPLBAsyncMPClient, rank: int, request_ids: list[str], why: str) -> None:
        for _ in request_ids:
            client.router.stats.on_failed(why)
        client.outputs_queue.put_nowait(
            RequestsLostError(
                request_ids,
                f"its requests could not move to another rank ({why})",
                engine_index=rank,
            )
        )

    def _log_move(
        self,
        client: DPLBAsyncMPClient,
        request_id: str,
        from_rank: int,
        entry: InFlightRequest,
        reason: str,
    ) -> None:
        request = entry.request
        assert request is not None
        logger.info(
            "request %s migrated from rank %d to rank %s carrying %d tokens (%s)",
            request_id,
            from_rank,
            client.rank_of(request_id),
            len(request.resumed_output_token_ids) + len(entry.token_ids),
            reason,
        )


def _being_taken_in(entries: dict[str, InFlightRequest], num_taken_in: int) -> str | None:
    """The request a rank was compiling a grammar for when it died, if it was: the oldest
    with structured outputs and without output of those it had not reported taken in
    (`num_taken_in` of this client's)."""
    unreported = [
        (entry.seq, request_id)
        for request_id, entry in entries.items()
        if entry.seq >= num_taken_in and not entry.has_output and _compiles_a_grammar(entry)
    ]
    return min(unreported)[1] if unreported else None


def _compiles_a_grammar(entry: InFlightRequest) -> bool:
    request = entry.request
    return request is not None and request.sampling_params.structured_outputs is not None


async def _until_a_rank_serves(client: DPLBAsyncMPClient, timeout_s: float) -> bool:
    """Polls (a rare path) until the client can route, while its ranks may come back."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not client.lb_engines:
        if not client.engine_set.returns.engines_can_return or loop.time() >= deadline:
            return False
        await asyncio.sleep(_WAIT_POLL_S)
    return True
