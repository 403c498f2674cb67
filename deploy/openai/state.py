"""`ServerState`: what every endpoint of one front end shares: its engine client, names, metrics.

The front end is one `AsyncLLM` attached to the cluster (its own DPLB client); it knows the
cluster's registry only to report the cluster's facts (rank states, attached clients, size,
resizes) in `/metrics`. A front end that follows its cluster (`follow`) is detached while no
cluster serves its namespace: then `llm` raises a 503 saying why, until `bind_cluster` binds
the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from shoal.actors.registry import RegistryHandle
from shoal.client.api.async_llm import AsyncLLM
from shoal.client.routing.router import RoutingStats
from shoal.deploy.metrics import POISON_COMPILE_CRASH, ServerMetrics, cache_config_labels
from shoal.deploy.openai.admission_gate import AdmissionConfig, AdmissionGate
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.grammar_sandbox import GrammarSandbox
from shoal.deploy.openai.limits import FrontEndLimits
from shoal.deploy.openai.lora import LoRAModules
from shoal.deploy.openai.tenant_metrics import QueueTimes, TenantCollector
from shoal.deploy.openai.tenants import TenantTable
from shoal.deploy.openai.tokenizer_pool import TokenizerPool
from shoal.deploy.openai.tools import ToolCallConfig
from shoal.engine.protocol import LoRARequest, SchedulerStats
from shoal.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A scrape waits at most this long for the registry's status; then it shows the last one.
_STATUS_TIMEOUT_S = 2.0


@dataclass
class ServerState:
    """One front end: its client, the names it answers to, its keys, bounds and metrics."""

    current_llm: AsyncLLM | None  # None while detached (`not_serving_reason` says why)
    model_name: str
    api_key: str | None
    registry: RegistryHandle | None = None  # the cluster's registry, when serving a cluster
    num_in_flight: int = 0  # POSTs in progress, streams until their last byte (`/load`)
    admin_api_key: str | None = None  # the resize endpoints' key (default: the one API key)
    limits: FrontEndLimits = field(default_factory=FrontEndLimits)
    tokenizer_pool: TokenizerPool | None = None  # made by `make`
    tool_calls: ToolCallConfig = field(default_factory=ToolCallConfig)  # the tool flags
    served_model_names: tuple[str, ...] = ()  # every name requests may use (`model_name` too)
    # Where a request is silent: `--generation-config`'s defaults (`generation_config.py`).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Why no cluster serves this front end now (None while one does): the 503s' message.
    not_serving_reason: str | None = None
    # Where output constraints are compiled first, before routing (`grammar_sandbox.py`).
    grammar_sandbox: GrammarSandbox = field(default_factory=GrammarSandbox)
    # The tenants, by API key (default: `api_key` alone, tenant `default`), and admission.
    tenants: TenantTable | None = None
    admission_config: AdmissionConfig = field(default_factory=AdmissionConfig)
    loras: LoRAModules = field(default_factory=LoRAModules)  # the LoRA adapters served by name
    admission: AdmissionGate = field(init=False)
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        if self.tenants is None:
            self.tenants = TenantTable.single(self.api_key)
        if self.admin_api_key is None:  # the API key, when there is just one
            self.admin_api_key = self.tenants.only_key
        self._queue_times = QueueTimes()
        self.admission = self.admission_config.make_gate(
            self.tenants, lambda: self.current_llm, self._queue_times.observe
        )
        self.metrics = self._make_metrics(self.model_name)

    @classmethod
    def make(
        cls,
        llm: AsyncLLM,
        model_name: str,
        api_key: str | None,
        registry: RegistryHandle | None = None,
        *,
        admin_api_key: str | None = None,
        limits: FrontEndLimits | None = None,
        tenants: TenantTable | None = None,
        admission_config: AdmissionConfig | None = None,
    ) -> ServerState:
        return cls(
            llm,
            model_name,
            api_key,
            registry,
            admin_api_key=admin_api_key or api_key,
            limits=limits or FrontEndLimits(),
            tokenizer_pool=TokenizerPool(llm.tokenizer),
            tenants=tenants,
            admission_config=admission_config or AdmissionConfig(),
        )

    def _make_metrics(self, model_name: str) -> ServerMetrics:
        """Metrics whose per-rank and routing series follow whichever client is bound."""

        def routing_stats() -> RoutingStats | None:
            llm = self.current_llm
            return None if llm is None else llm.routing_stats()

        metrics = ServerMetrics(
            model_name, self.rank_stats, routing_stats, self.cache_config_info, self.poison_counts
        )
        tenants = TenantCollector(model_name, lambda: self.admission, self._queue_times)
        metrics.registry.register(tenants)
        return metrics

    def poison_counts(self) -> dict[str, int]:
        """Requests refused as poison, by reason (`shoal:poison_requests_total`): by the grammar
        sandbox, and by the client's migrator (counted since this cluster was bound)."""
        counts = {POISON_COMPILE_CRASH: self.grammar_sandbox.num_poisoned}
        stats = None if self.current_llm is None else self.current_llm.routing_stats()
        if stats is not None:
            counts.update(stats.poisoned)
        return counts

    @property
    def llm(self) -> AsyncLLM:
        """The client of the cluster this front end serves.

        Raises:
            OpenAIError: no cluster serves it now (503, saying why).
        """
        if self.current_llm is None:
            raise self.not_serving_error()
        return self.current_llm

    def not_serving_error(self) -> OpenAIError:
        """The 503 every request gets while no cluster serves this front end."""
        return OpenAIError(
            self.not_serving_reason or "no cluster serves this front end",
            HTTPStatus.SERVICE_UNAVAILABLE,
            code="cluster_not_serving",
        )

    def shutdown_pool(self) -> None:
        if self.tokenizer_pool is not None:
            self.tokenizer_pool.shutdown()
        self.grammar_sandbox.close()  # ends the children at once (`aclose` also waits)

    def bind_cluster(self, llm: AsyncLLM, registry: RegistryHandle, model_name: str) -> None:
        """Serves `llm`'s cluster from now on (after `detach_cluster`, the next cluster of the
        namespace). Metrics restart only if the reported model name changes."""
        old_pool = self.tokenizer_pool
        self.tokenizer_pool = TokenizerPool(llm.tokenizer)
        if old_pool is not None:
            old_pool.shutdown()
        if model_name != self.model_name:
            self.metrics = self._make_metrics(model_name)
        self.model_name = model_name
        self.registry = registry
        self.current_llm = llm
        self.not_serving_reason = None

    def detach_cluster(self, reason: str) -> AsyncLLM | None:
        """Stops serving the cluster: from now on every request gets a 503 saying `reason`.

        Returns:
            The client that served it (the caller closes it), or None if none was bound.
        """
        llm, self.current_llm = self.current_llm, None
        self.not_serving_reason = reason
        self.registry = None
        self.metrics.cluster.clear()
        return llm

    @property
    def pool(self) -> TokenizerPool:
        """Where tokenizer work runs, off the event loop.

        Raises:
            OpenAIError: no cluster serves this front end now (503).
        """
        if self.current_llm is None:
            raise self.not_serving_error()
        assert self.tokenizer_pool is not None, "ServerState.make makes the pool"
        return self.tokenizer_pool

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm.tokenizer

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for: the engines' `--max-logprobs`."""
        return self.llm.config.model.max_logprobs

    @property
    def max_model_len(self) -> int | None:
        return self.llm.max_model_len

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names, or None for the base model.

        Raises:
            OpenAIError: a model this server does not serve (404).
        """
        lora = None if model is None else self.loras.get(model)
        if lora is not None:
            return lora
        if model is not None and model != self.model_name and model not in self.served_model_names:
            raise OpenAIError(
                f"the model `{model}` does not exist (this server serves `{self.model_name}`)",
                HTTPStatus.NOT_FOUND,
                param="model",
                code="model_not_found",
            )
        return None

    def serving_ranks(self) -> list[int]:
        """The ranks this front end can route requests to now (none while detached)."""
        llm = self.current_llm
        return [] if llm is None else llm.serving_ranks()

    def cache_config_info(self) -> dict[int, dict[str, str]]:
        """Each attached rank's KV cache configuration, as `vllm:cache_config_info` labels."""
        llm = self.current_llm
        if llm is None:
            return {}
        return {
            rank: cache_config_labels(llm.config.cache, facts)
            for rank, facts in llm.engine_core.engine_facts().items()
        }

    def rank_stats(self) -> dict[int, SchedulerStats]:
        """The latest published stats of each rank the front end is attached to."""
        llm = self.current_llm
        return {} if llm is None else llm.rank_stats()

    async def refresh_cluster_facts(self) -> None:
        """Reads the cluster's facts from the registry for the next scrape: rank states,
        attached clients, its size, the resize running and the past ones."""
        if self.registry is None:
            return
        with contextlib.suppress(Exception):  # a registry restarting: keep the last facts
            status = await asyncio.wait_for(
                asyncio.wrap_future(self.registry.status.remote().future()), _STATUS_TIMEOUT_S
            )
            facts = self.metrics.cluster
            facts.ranks_by_state = dict(Counter(str(r["state"]) for r in status["ranks"]))
            facts.num_clients = len(status["clients"])
            facts.data_parallel_size = int(status["data_parallel_size"])
            facts.is_scaling = status.get("scaling") is not None
            facts.autoscaler = status.get("autoscaler")
            self.metrics.observe_scale_history(status.get("scale_history") or [])
