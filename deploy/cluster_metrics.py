"""The cluster's series of a front end's `/metrics` (see `shoal.deploy.metrics` for them all):
what the registry said last about the ranks, the clients, the size, a resize in progress and
the autoscaler, refreshed before each scrape (`ClusterFacts`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.cluster.autoscale_policy import DIRECTION_OF_REASON


@dataclass
class ClusterFacts:
    """What the registry says about the cluster, refreshed before each scrape."""

    ranks_by_state: dict[str, int] = field(default_factory=dict)
    num_clients: int = 0
    data_parallel_size: int | None = None  # None until the registry has answered once
    is_scaling: bool = False
    autoscaler: dict[str, Any] | None = None  # `status()["autoscaler"]`: None without one

    def clear(self) -> None:
        """Forgets the facts (the cluster is gone), as before the registry first answered."""
        self.ranks_by_state = {}
        self.num_clients = 0
        self.data_parallel_size = None
        self.is_scaling = False
        self.autoscaler = None


class ClusterCollector(Collector):
    """The cluster's gauges, from what the registry said last (`ClusterFacts`)."""

    def __init__(self, model_name: str, cluster: ClusterFacts) -> None:
        self._model_name = model_name
        self._cluster = cluster

    def collect(self) -> Iterator[Metric]:
        ranks = GaugeMetricFamily(
            "shoal:ranks", "The cluster's ranks by state.", labels=["model_name", "state"]
        )
        for state, count in sorted(self._cluster.ranks_by_state.items()):
            ranks.add_metric([self._model_name, state], count)
        yield ranks
        clients = GaugeMetricFamily(
            "shoal:attached_clients",
            "Clients (front ends, drivers) attached to the cluster.",
            labels=["model_name"],
        )
        clients.add_metric([self._model_name], self._cluster.num_clients)
        yield clients
        if self._cluster.data_parallel_size is not None:
            size = GaugeMetricFamily(
                "shoal:data_parallel_size", "The cluster's ranks.", labels=["model_name"]
            )
            size.add_metric([self._model_name], self._cluster.data_parallel_size)
            yield size
        scaling = GaugeMetricFamily(
            "shoal:scale_in_progress", "1 while a resize runs, else 0.", labels=["model_name"]
        )
        scaling.add_metric([self._model_name], int(self._cluster.is_scaling))
        yield scaling
        if self._cluster.autoscaler is not None:
            yield from self._autoscaler(self._cluster.autoscaler)

    def _autoscaler(self, record: dict[str, Any]) -> Iterator[Metric]:
        """The autoscaler's decisions by direction and reason (every pair from the first
        scrape on, at 0), the size it wants and the ranks serving now."""
        labels = ["model_name"]
        decisions = CounterMetricFamily(
            "shoal:autoscaler_decisions",
            "The autoscaler's resizes, by direction and why.",
            labels=[*labels, "direction", "reason"],
        )
        totals = record.get("decisions_total", {})
        for reason, direction in DIRECTION_OF_REASON.items():
            count = totals.get(f"{direction}/{reason}", 0)
            decisions.add_metric([self._model_name, direction, reason], count)
        yield decisions
        serving = self._cluster.ranks_by_state.get("ready", 0)
        for name, value, doc in (
            ("desired", record["desired_size"], "The size the autoscaler wants."),
            ("current", serving, "The ranks serving now (pending ones are no capacity)."),
        ):
            family = GaugeMetricFamily(f"shoal:autoscaler_{name}_size", doc, labels=labels)
            family.add_metric([self._model_name], value)
            yield family
