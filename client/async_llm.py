"""`AsyncLLM`: streaming generation for asyncio programs, from one engine or a whole cluster.

`AsyncLLM(model=...)` starts one engine core in a child process (no Ray); `AsyncLLM.connect`
attaches to a running cluster by namespace. Either way one background task reads engine
outputs, detokenizes them and hands each request's outputs to its `generate` stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from shoal.client.async_mp_client import AsyncMPClient
from shoal.client.engine_client import EngineCoreClient
from shoal.client.fan_out import generate_fan_out
from shoal.client.migration import DEFAULT_MIGRATION_LIMIT, RequestsLostError
from shoal.client.output_processor import OutputProcessor, RequestOutputCollector
from shoal.client.outputs import RequestOutput
from shoal.client.prompts import PromptType, tokenize_prompt
from shoal.client.routing import RequestRouter, RoutingStats
from shoal.engine.config import EngineConfig
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import EngineCoreRequest, SamplingParams, SchedulerStats
from shoal.engine.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from shoal.client.cluster_link import ClusterLink

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Async generation with per-request streams.

    Args:
        model: local path to a Hugging Face checkpoint directory or a GGUF file.
        **engine_kwargs: engine settings named like vLLM's (see `LLM`).

    Raises:
        RuntimeError: the engine process failed to start (the message carries its error).
    """

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        config = EngineConfig.from_kwargs(model, **engine_kwargs)
        tokenizer = load_tokenizer(config.model.tokenizer or model)
        self._setup(config, tokenizer, AsyncMPClient.make_local(config), None)

    @classmethod
    async def connect(
        cls,
        namespace: str = "shoal",
        *,
        address: str = "auto",
        host: str | None = None,
        name: str | None = None,
        policy: str = "cache-aware",
        ready_timeout_s: float = 0.0,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
    ) -> AsyncLLM:
        """Attaches to a running shoal cluster (started by `shoal serve` or `shoal.cluster.launch`).

        Args:
            namespace: the cluster's Ray namespace.
            address: Ray address for `ray.init` when Ray is not initialized yet.
            host: this machine's address as the engines should reach it; default: Ray's node IP.
            name: how this client is listed by `shoal status`.
            policy: the routing policy: "cache-aware" (prefix cache weighed against load),
                "least-loaded", "round-robin" or "queue-length" (vLLM's score).
            ready_timeout_s: how long to wait for a cluster that is still being launched (by a
                `shoal serve` job just submitted, say) until one of its ranks serves. 0: no
                wait.
            migration_limit: how often one request may move to another rank when its rank
                dies or hangs; it goes on from the tokens already streamed, so the stream
                neither repeats nor skips a token (`shoal.client.migration`). Past the limit,
                for a request pinned by `data_parallel_rank`, or with 0, the request fails
                with `EngineDeadError`.

        Raises:
            ClusterNotFoundError: no cluster runs in the namespace (within `ready_timeout_s`).
            TimeoutError: no rank of the cluster served within `ready_timeout_s`.
        """
        from shoal.client.cluster_link import ClusterLink

        link = await ClusterLink.attach(
            namespace,
            address=address,
            host=host,
            name=name,
            policy=policy,
            ready_timeout_s=ready_timeout_s,
            migration_limit=migration_limit,
        )
        try:
            tokenizer = await link.load_tokenizer()
        except BaseException:
            await link.aclose()
            raise
        self = cls.__new__(cls)
        self._setup(link.membership.config, tokenizer, link.client, link)
        return self

    def _setup(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        client: EngineCoreClient,
        link: ClusterLink | None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.engine_core = client
        self.output_processor = OutputProcessor(tokenizer)
        self._link = link
        self._output_handler: asyncio.Task[None] | None = None
        self._dead_error: EngineDeadError | None = None

    # --- generation ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams one request's outputs until it finishes.

        Cancelling the consumer (or closing the generator) aborts the request in the engine.

        Args:
            prompt: text, token ids, or a vLLM prompt dict.
            sampling_params: default `SamplingParams()`.
            request_id: default a fresh uuid; unique among this client's live requests
                (other drivers of a cluster may use the same ids).
            data_parallel_rank: pin the request to one rank (cluster mode).
            session_id: keep the requests of this session (a conversation, a user) on one
                rank while that rank's load allows, so each turn finds the previous turns in
                its prefix cache (cluster mode); None: routed by cache and load alone.

        Raises:
            RequestError: the engine rejected the request (the message says why).
            EngineDeadError: the engine serving it died.
        """
        params = sampling_params or SamplingParams()
        external_id = request_id or uuid.uuid4().hex
        if params.n > 1:  # n engine requests, merged (`shoal.client.fan_out`)
            children = generate_fan_out(
                lambda child, child_id: self._generate_one(
                    prompt, child, child_id, data_parallel_rank, session_id
                ),
                params,
                external_id,
            )
            async with contextlib.aclosing(children) as merged_outputs:
                async for merged in merged_outputs:
                    yield merged
            return
        # aclosing: a consumer that stops early aborts the engine request now, not at GC.
        one = self._generate_one(prompt, params, external_id, data_parallel_rank, session_id)
        async with contextlib.aclosing(one) as outputs:
            async for output in outputs:
                yield output

    async def _generate_one(
        self,
        prompt: PromptType,
        params: SamplingParams,
        external_id: str,
        data_parallel_rank: int | None,
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self._check_loop()
        if self._dead_error is not None:
            raise self._dead_error
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        request = EngineCoreRequest(
            request_id=self._engine_request_id(external_id),
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=time.time(),
            data_parallel_rank=data_parallel_rank,
        )
        collector = RequestOutputCollector(params.output_kind)
        state = self.output_processor.add_request(request, text, collector, external_id)
        self._ensure_output_handler()
        try:
            await self.engine_core.add_request_async(request, session_id=session_id)
        except BaseException:
            self.output_processor.remove_request(request.request_id)
            raise
        state.engine_index = self.engine_core.rank_of(request.request_id)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                if output.error is not None:
                    raise RequestError(output.error)
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                await self._abort(request.request_id)
            raise

    def _engine_request_id(self, request_id: str) -> str:
        """The id a request of this client has in the engines: the caller's, made unique among
        every client's by this client's index, so drivers sharing a cluster may choose the
        same ids. The last "-c" is ours (an index has none), so no two clients' ids meet."""
        return f"{request_id}-c{self.engine_core.client_index}"

    async def abort(self, request_id: str) -> None:
        """Aborts a request (by the id `generate` was given) here and in its engine."""
        self._check_loop()
        await self._abort(self._engine_request_id(request_id))

    async def _abort(self, engine_request_id: str) -> None:
        self.output_processor.abort_requests([engine_request_id])
        if self._dead_error is None and not self.engine_core.is_closed:
            with contextlib.suppress(EngineDeadError):  # nothing left to abort there
                await self.engine_core.abort_requests_async([engine_request_id])

    # --- the output handler -------------------------------------------------------------------

    def _check_loop(self) -> None:
        """Refuses a loop other than the one this client's tasks run on.

        Its output tasks (this one's and its engine client's) and queues belong to the loop
        that first used it. A second `asyncio.run()` would otherwise wait for outputs that
        nothing reads.

        Raises:
            RuntimeError: called on another event loop.
        """
        loop = asyncio.get_running_loop()
        handler = self._output_handler
        loops = (handler.get_loop() if handler is not None else None, self.engine_core.event_loop())
        if any(bound is not None and bound is not loop for bound in loops):
            raise RuntimeError(
                "this AsyncLLM runs on another event loop (a second asyncio.run()?); "
                "create the AsyncLLM inside the loop that uses it, or shut it down and make a "
                "new one"
            )

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.create_task(
                self._run_output_handler(), name="AsyncLLMOutputHandler"
            )

    async def _run_output_handler(self) -> None:
        client = self.engine_core
        processor = self.output_processor
        while True:
            try:
                outputs = await client.get_output_async()
            except RequestsLostError as lost:  # requests that could not move off a failed rank
                processor.fail_requests(lost.request_ids, lost)
                continue
            except EngineDeadError as dead:
                alive = not client.is_terminal(dead)
                if alive and dead.engine_index is not None:
                    # Not those the rank handed to another one before it went (a resize), nor
                    # those moving to another one now (a failure).
                    ids = [
                        rid
                        for rid in processor.request_ids_on_engine(dead.engine_index)
                        if client.rank_of(rid) in (None, dead.engine_index)
                        and not client.is_moving(rid)
                    ]
                else:
                    ids = processor.request_ids()
                processor.fail_requests(ids, dead)
                if not alive:
                    logger.error("no engine can serve this client any more: %s", dead)
                    self._dead_error = dead
                    return
                continue
            processed = processor.process_outputs(outputs.outputs, outputs.engine_index)
            if processed.reqs_to_abort:
                # A dead engine's death is reported through this loop anyway.
                with contextlib.suppress(EngineDeadError):
                    await client.abort_requests_async(processed.reqs_to_abort)

    # --- utilities ------------------------------------------------------------------------------

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    def serving_ranks(self) -> list[int]:
        """The ranks (engine indices) that take new requests now."""
        return [] if self.errored else self.engine_core.serving_engines()

    def rank_stats(self) -> dict[int, SchedulerStats]:
        """Each rank's load as the coordinator last published it (empty for a local engine)."""
        return self.engine_core.latest_stats()

    def routing_stats(self) -> RoutingStats | None:
        """This client's routing totals (None for a local engine: nothing is routed)."""
        router = getattr(self.engine_core, "router", None)
        return router.stats if isinstance(router, RequestRouter) else None

    @property
    def max_model_len(self) -> int | None:
        """The context length the engines serve (as they said at HELLO), else the config's."""
        for facts in self.engine_core.engine_facts().values():
            return facts.max_model_len
        return self.config.model.max_model_len

    async def get_stats(self) -> SchedulerStats:
        """The serving engine's load (the first rank's, in cluster mode)."""
        self._check_loop()
        stats: SchedulerStats = await self.engine_core.call_utility_async("get_stats")
        return stats

    async def reset_prefix_cache(self) -> bool:
        self._check_loop()
        result: bool = await self.engine_core.call_utility_async("reset_prefix_cache")
        return result

    async def scale_elastic_ep(self, new_data_parallel_size: int, **kwargs: Any) -> dict[str, Any]:
        """Resizes the attached cluster to `new_data_parallel_size` ranks while it serves
        (expert-parallel or dense; `shoal.cluster.elastic` has the steps and guarantees), and
        returns once this client routes over the new set.

        Args:
            new_data_parallel_size: the number of ranks after the resize.
            **kwargs: passed to `shoal.cluster.elastic.scale` (e.g. `switch_timeout_s`).

        Returns:
            The resize's report (epoch, sizes, outcome, seconds per phase).

        Raises:
            RuntimeError: this client is not attached to a cluster (`AsyncLLM.connect`).
            ValueError: a size the model cannot be served at.
            ScaleInProgressError: another resize is in progress.
            ScaleError: the resize failed and was rolled back.
        """
        if self._link is None:
            raise RuntimeError(
                "scale_elastic_ep needs a client attached to a cluster (AsyncLLM.connect)"
            )
        report = await self._link.scale(new_data_parallel_size, **kwargs)
        return report.as_dict()

    async def is_scaling_elastic_ep(self) -> bool:
        """Whether a resize of the attached cluster is in progress (False without one)."""
        return self._link is not None and await self._link.is_scaling()

    def shutdown(self) -> None:
        """Closes everything now, as vLLM's `AsyncLLM.shutdown()`: a plain method, callable
        with or without a running loop (from a coroutine, `await aclose()` is the graceful form).

        Fails every open stream, stops the output handler, says GOODBYE to the engines (which
        drops this client's requests there) and detaches from the cluster registry.
        Idempotent.
        """
        pending = self.output_processor.request_ids()
        if pending:
            self.output_processor.fail_requests(pending, EngineDeadError("the client shut down"))
        self._dead_error = EngineDeadError("the client shut down")
        handler = self._output_handler
        if handler is not None and not handler.done() and not handler.get_loop().is_closed():
            handler.get_loop().call_soon_threadsafe(handler.cancel)
        if self._link is not None:
            self._link.shutdown()
        else:
            self.engine_core.shutdown()

    async def aclose(self) -> None:
        """`shutdown` from a coroutine: aborts this client's requests in the engines and waits
        for the output handler to end before detaching."""
        handler = self._output_handler
        # From another loop (the first one has closed): its tasks are over, and detaching
        # (GOODBYE) aborts this client's requests in the engines anyway.
        on_own_loop = handler is None or handler.get_loop() is asyncio.get_running_loop()
        pending = self.output_processor.request_ids()
        if pending:
            self.output_processor.fail_requests(pending, EngineDeadError("the client shut down"))
            if on_own_loop:
                with contextlib.suppress(EngineDeadError):
                    await self.engine_core.abort_requests_async(pending)
        self._dead_error = EngineDeadError("the client shut down")
        if handler is not None and on_own_loop:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        if self._link is not None:
            await self._link.aclose()
        else:
            self.engine_core.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
