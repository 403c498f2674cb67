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
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from shoal.client.async_llm import AsyncLLM
from shoal.deploy.metrics import ServerMetrics
from shoal.deploy.openai.errors import OpenAIError
from shoal.engine.protocol import SchedulerStats
from shoal.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A scrape waits at most this long for the registry's status; then it shows the last one.
_STATUS_TIMEOUT_S = 2.0


@dataclass
class ServerState:
    """One front end: its client, the names it answers to, its key and metrics."""

    llm: AsyncLLM
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    registry: Any = None  # the cluster registry's actor handle, when serving a cluster
    num_in_flight: int = 0  # POSTs in progress, streams until their last byte (`/load`)

    @classmethod
    def make(
        cls,
        llm: AsyncLLM,
        model_name: str,
        api_key: str | None,
        registry: Any = None,
    ) -> ServerState:
        metrics = ServerMetrics(model_name, lambda: rank_stats(llm))
        return cls(llm, model_name, api_key, metrics, registry)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return self.llm.max_model_len

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError (404) for a model this server does not serve."""
        if model is not None and model != self.model_name:
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
