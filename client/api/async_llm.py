"""`AsyncLLM`: streaming generation for asyncio programs, from one engine or a whole cluster.

`AsyncLLM(model=...)` starts one engine core in a child process (no Ray); `AsyncLLM.connect`
attaches to a running cluster by namespace. Either way one background task
(`shoal.client.api.output_handler`) reads engine outputs, detokenizes them and hands each
request's outputs to its `generate` stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from shoal.client.api.fan_out import generate_fan_out
from shoal.client.api.output_handler import OutputHandler
from shoal.client.api.output_processor import OutputProcessor
from shoal.client.api.outputs import EmbeddingRequestOutput, RequestOutput
from shoal.client.api.prompts import PromptType, TokenizedPrompt, tokenize_prompt
from shoal.client.routing.migration import DEFAULT_MIGRATION_LIMIT
from shoal.client.routing.router import RequestRouter, RoutingStats
from shoal.client.transport.async_mp_client import AsyncMPClient
from shoal.client.transport.engine_client import EngineCoreClient
from shoal.engine.config import EngineConfig
from shoal.engine.loader.hub import local_model_config
from shoal.engine.protocol import (
    POOLING_OUTPUT,
    EngineCoreRequest,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    SchedulerStats,
)
from shoal.engine.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from shoal.client.routing.cluster_link import ClusterLink
    from shoal.client.routing.lb_policy import LoadBalancePolicy

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
        config = local_model_config(EngineConfig.from_kwargs(model, **engine_kwargs))
        tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        self._setup(config, tokenizer, AsyncMPClient.make_local(config), None)

    @classmethod
    async def connect(
        cls,
        namespace: str = "shoal",
        *,
        address: str = "auto",
        host: str | None = None,
        name: str | None = None,
        policy: str | LoadBalancePolicy = "cache-aware",
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
                "least-loaded", "round-robin" or "queue-length" (vLLM's score); or a policy
                object (`shoal.client.routing.lb_policy`: a `make_policy(...)` with other
                options, or one of its own), used as given.
            ready_timeout_s: how long to wait for a cluster that is still being launched (by a
                `shoal serve` job just submitted, say) until one of its ranks serves. 0: no
                wait.
            migration_limit: how often one request may move to another rank when its rank
                dies or hangs; it goes on from the tokens already streamed, so the stream
                neither repeats nor skips a token (`shoal.client.routing.migration`). Past the limit,
                for a request pinned by `data_parallel_rank`, or with 0, the request fails
                with `EngineDeadError`.

        Raises:
            ClusterNotFoundError: no cluster runs in the namespace (within `ready_timeout_s`).
            TimeoutError: no rank of the cluster served within `ready_timeout_s`.
        """
        from shoal.client.routing.cluster_link import ClusterLink

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
        self._outputs = OutputHandler(client, self.output_processor)
        self._link = link

    # --- generation ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams one request's outputs until it finishes.

        Cancelling the consumer (or closing the generator) aborts the request in the engine.

        Args:
            prompt: text, token ids, a vLLM prompt dict, or a `TokenizedPrompt` (taken as
                it is: tokenized once, for every sequence of `n > 1`).
            sampling_params: default `SamplingParams()`.
            request_id: default a fresh uuid; unique among this client's live requests
                (other drivers of a cluster may use the same ids: each engine scopes a
                request's id by the client that sent it).
            data_parallel_rank: pin the request to one rank (cluster mode).
            session_id: keep the requests of this session (a conversation, a user) on one
                rank while that rank's load allows, so each turn finds the previous turns in
                its prefix cache (cluster mode); None: routed by cache and load alone.
            priority: vLLM's request priority, lower first; engines started with
                `scheduling_policy="priority"` take their waiting requests in this order (and
                preempt the least urgent first); under "fcfs" it is ignored.
            lora_request: the LoRA adapter to run with (engines started with `enable_lora`).

        Raises:
            RequestError: the engine rejected the request (the message says why).
            EngineDeadError: the engine serving it died.
        """
        params = sampling_params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        tokenized = tokenize_prompt(self.tokenizer, prompt)
        if params.n > 1:  # n engine requests, merged (`shoal.client.api.fan_out`)
            children = generate_fan_out(
                lambda child, child_id: self._outputs.stream(
                    _request(
                        tokenized, child, child_id, data_parallel_rank, priority, lora_request
                    ),
                    tokenized.text,
                    session_id,
                ),
                params,
                request_id,
            )
            async with contextlib.aclosing(children) as merged_outputs:
                async for merged in merged_outputs:
                    yield merged
            return
        # aclosing: a consumer that stops early aborts the engine request now, not at GC.
        request = _request(
            tokenized, params, request_id, data_parallel_rank, priority, lora_request
        )
        one = self._outputs.stream(request, tokenized.text, session_id)
        async with contextlib.aclosing(one) as outputs:
            async for output in outputs:
                yield output

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """One prompt's pooled final hidden state from a pooling engine (`runner="pooling"`),
        as vLLM's `AsyncLLM.encode`: one output, when it finishes.

        Raises:
            RequestError: the engine rejected the request (a generating engine, say).
            EngineDeadError: the engine serving it died.
        """
        tokenized = tokenize_prompt(self.tokenizer, prompt)
        request = _request(
            tokenized,
            POOLING_OUTPUT,
            request_id or uuid.uuid4().hex,
            data_parallel_rank,
            pooling_params=pooling_params or PoolingParams(),
        )
        one = self._outputs.stream(request, tokenized.text)
        async with contextlib.aclosing(one) as outputs:
            async for output in outputs:
                yield EmbeddingRequestOutput.of(output)

    async def abort(self, request_id: str) -> None:
        """Aborts a request (by the id `generate` was given) here and in its engine."""
        self._outputs.check_loop()
        await self._outputs.abort(request_id)

    # --- utilities ------------------------------------------------------------------------------

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    @property
    def errored(self) -> bool:
        return self._outputs.dead_error is not None

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
        self._outputs.check_loop()
        stats: SchedulerStats = await self.engine_core.call_utility_async("get_stats")
        return stats

    async def reset_prefix_cache(self) -> bool:
        self._outputs.check_loop()
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
        self._outputs.close()
        if self._link is not None:
            self._link.shutdown()
        else:
            self.engine_core.shutdown()

    async def aclose(self) -> None:
        """`shutdown` from a coroutine: aborts this client's requests in the engines and waits
        for the output handler to end before detaching."""
        await self._outputs.aclose()
        if self._link is not None:
            await self._link.aclose()
        else:
            self.engine_core.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _request(
    tokenized: TokenizedPrompt,
    params: SamplingParams,
    request_id: str,
    data_parallel_rank: int | None,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
    *,
    pooling_params: PoolingParams | None = None,
) -> EngineCoreRequest:
    """The engine request of one sequence of a prompt (or of its pooling)."""
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tokenized.token_ids,
        sampling_params=params,
        arrival_time=time.time(),
        data_parallel_rank=data_parallel_rank,
        pooling_params=pooling_params,
        priority=priority,
        lora_request=lora_request,
    )
