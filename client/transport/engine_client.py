"""The typed interface the user APIs hold an engine-core client by.

`AsyncLLM` drives any `EngineCoreClient` — one engine in a child process (`AsyncMPClient`) or a
cluster's ranks (`DPLBAsyncMPClient`) — and never reaches into a client's internals. The
cluster link additionally changes which ranks a DP client has, through `EngineSetClient`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from shoal.engine.errors import EngineDeadError
from shoal.engine.parallel.elastic import ScaleNotice
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineEndpoint,
    EngineFacts,
    SchedulerStats,
)


class EngineCoreClient(Protocol):
    """An asyncio client of one or more engine cores."""

    client_index: int

    @property
    def is_closed(self) -> bool: ...

    async def add_request_async(
        self, request: EngineCoreRequest, *, session_id: str | None = None
    ) -> None:
        """Sends a request to an engine (the client picks which; a router keeps the requests
        of one `session_id` on one rank while its load allows)."""

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Aborts requests wherever they run."""

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs; raises `EngineDeadError` for an engine's death."""

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Calls an allowed engine utility method."""

    def rank_of(self, request_id: str) -> int | None:
        """The engine index serving an in-flight request."""

    def is_moving(self, request_id: str) -> bool:
        """Whether a request left a failed engine and is on its way to another one."""

    def serving_engines(self) -> list[int]:
        """The engine indices that take new requests now (attached, not counted dead)."""

    def engine_facts(self) -> dict[int, EngineFacts]:
        """What each live attached engine said of itself at HELLO, by index."""

    def latest_stats(self) -> dict[int, SchedulerStats]:
        """Each engine's load as last published to this client (empty without a stats
        subscription)."""

    def is_terminal(self, dead: EngineDeadError) -> bool:
        """Whether a death ends the client's outputs for good."""

    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the client's output task runs on (None before it starts)."""

    def shutdown(self) -> None: ...


class EngineSetClient(EngineCoreClient, Protocol):
    """A DP client whose ranks someone else (the cluster link) attaches and detaches."""

    stats_address: str | None

    @property
    def lb_engines(self) -> list[int]: ...

    def endpoints(self) -> dict[int, EngineEndpoint]:
        """The ranks this client has (attached, attaching, or counted dead)."""

    def dead_ranks(self) -> list[int]:
        """The ranks this client counts dead."""

    def set_engines_can_return(self, can_return: bool) -> None:
        """Whether dead ranks may be attached again (then no death is terminal)."""

    def add_engine_lost_listener(self, listener: Callable[[int], None]) -> None: ...

    def add_scale_listener(self, listener: Callable[[str, ScaleNotice], None]) -> None:
        """Hears every elastic notification (kind, notice)."""

    def set_rank_draining(self, engine_index: int, is_draining: bool) -> None:
        """Stops (or resumes) routing new requests to a rank that is leaving."""

    async def add_engine_async(self, endpoint: EngineEndpoint) -> EngineFacts: ...

    async def reattach_engine_async(self, engine_index: int) -> EngineFacts: ...

    def remove_engine(self, engine_index: int) -> None: ...

    def set_stats_address(self, address: str) -> None: ...
