"""`ServerState`: what every endpoint of one front end shares: its engine client, names, metrics.

The front end is one `AsyncLLM` attached to the cluster (its own DPLB client); it knows the
cluster's registry only to report the cluster's facts (rank states, attached clients, size,
resizes) in `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from shoal.client.async_llm import AsyncLLM
from shoal.deploy.metrics import ServerMetrics
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.limits import FrontEndLimits
from shoal.deploy.openai.tokenizer_pool import TokenizerPool
from shoal.deploy.openai.tools import ToolCallConfig
from shoal.engine.protocol import SchedulerStats
from shoal.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A scrape waits at most this long for the registry's status; then it shows the last one.
_STATUS_TIMEOUT_S = 2.0


@dataclass
class ServerState:
    """One front end: its client, the names it answers to, its keys, bounds and metrics."""

    llm: AsyncLLM
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    registry: Any = None  # the cluster registry's actor handle, when serving a cluster
    num_in_flight: int = 0  # POSTs in progress, streams until their last byte (`/load`)
    admin_api_key: str | None = None  # the resize endpoints' key (default: `api_key`)
    limits: FrontEndLimits = field(default_factory=FrontEndLimits)
    tokenizer_pool: TokenizerPool | None = None  # made by `make`
    tool_calls: ToolCallConfig = field(default_factory=ToolCallConfig)  # the tool flags
    served_model_names: tuple[str, ...] = ()  # every name requests may use (`model_name` too)
    # Where a request is silent: `--generation-config`'s defaults (`generation_config.py`).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(
        cls,
        llm: AsyncLLM,
        model_name: str,
        api_key: str | None,
        registry: Any = None,
        *,
        admin_api_key: str | None = None,
        limits: FrontEndLimits | None = None,
    ) -> ServerState:
        metrics = ServerMetrics(model_name, lambda: rank_stats(llm), llm.routing_stats)
        return cls(
            llm,
            model_name,
            api_key,
            metrics,
            registry,
            admin_api_key=admin_api_key or api_key,
            limits=limits or FrontEndLimits(),
            tokenizer_pool=TokenizerPool(llm.tokenizer),
        )

    @property
    def pool(self) -> TokenizerPool:
        """Where tokenizer work runs, off the event loop."""
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

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError (404) for a model this server does not serve."""
        if model is not None and model != self.model_name and model not in self.served_model_names:
            raise OpenAIError(
                f"the model `{model}` does not exist (this server serves `{self.model_name}`)",
                HTTPStatus.NOT_FOUND,
                param="model",
                code="model_not_found",
            )

    def serving_ranks(self) -> list[int]:
        """The ranks this front end can route requests to now."""
        return self.llm.serving_ranks()

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
            self.metrics.observe_scale_history(status.get("scale_history") or [])


def rank_stats(llm: AsyncLLM) -> dict[int, SchedulerStats]:
    """The latest published stats of each rank the front end's DP client is attached to."""
    return llm.rank_stats()
