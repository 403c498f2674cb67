"""Prometheus metrics of one HTTP front end, under vLLM's names and labels, plus `shoal:` ones.

Three sources, nothing polled from the engines:

- Per-rank series (`vllm:num_requests_running`, `..._waiting`, `vllm:kv_cache_usage_perc`,
  `vllm:num_preemptions_total`, `vllm:prefix_cache_{queries,hits}_total`) are read at scrape
  time from the coordinator's stats stream that this front end's DP client subscribes to. They
  describe the rank, so every front end of a cluster shows the same values: aggregate them
  across front ends with `max by (engine)`, not `sum`. So is the histogram
  `vllm:iteration_tokens_total`: the tokens each engine step computed (every step of the
  rank, whichever front end sent its requests; vLLM's buckets, 1 to 16,384).
- Cluster series are read from the registry before each scrape (`ClusterFacts`):
  `shoal:ranks{state}`, `shoal:attached_clients`, `shoal:data_parallel_size`,
  `shoal:scale_in_progress` (1 while a resize runs), and the resizes the registry keeps (its
  last 32), `shoal:scale_events_total{outcome}` and `shoal:scale_duration_seconds{outcome}`
  (outcome "committed", "rolled_back", "unchanged", or "drained": a rank drained by `shoal
  drain`). Each resize is counted once per front
  end however often it is scraped (by its epoch), and a front end that starts later counts the
  past ones it finds in the registry, so every front end shows the same cluster-wide values:
  `max`, not `sum`. With an autoscaler (`shoal serve --autoscale`):
  `shoal:autoscaler_decisions_total{direction,reason}` (its resizes, by "up"/"down" and
  why: `shoal.cluster.autoscale_policy.REASONS`), `shoal:autoscaler_desired_size` and
  `shoal:autoscaler_current_size` (the ranks serving now; pending ones are not capacity),
  as the registry keeps them: the same on every front end.
- Request series (token counters, `vllm:request_success_total`, the latency and size
  histograms, `shoal:requests_routed_total`) count what this front end served. Each front end
  is its own scrape target; `sum` over targets gives the cluster's totals.
- `vllm:cache_config_info`, an info gauge (always 1) per rank whose labels are the KV cache's
  configuration as vLLM names it (`block_size`, `num_gpu_blocks`, `enable_prefix_caching`,
  `cache_dtype`, ...), from what each engine said at HELLO and the cluster's config;
  `gpu_memory_utilization` only for a rank on a GPU (`EngineFacts.device`).
- Routing series, read at scrape time from this front end's router (`RoutingStats`):
  `shoal:routing_decisions_total{reason}` (reason "cache", "load", "session" or "only-rank"),
  and the prompt tokens the router predicted the chosen rank held cached against those the
  engine found, `shoal:routing_predicted_hit_tokens_total` and
  `shoal:routing_actual_hit_tokens_total`. Per front end: `sum` over targets.
  `shoal:requests_migrated_total{reason}` counts requests moved to another rank (reason
  "rank_failed": it died, hung or let this front end go; "resize": it left in a scale-down),
  `shoal:requests_failed_total{reason}` those lost instead ("migration_limit", "pinned",
  "no_rank", "resize"; see `shoal.client.routing.migration`).
- `shoal:poison_requests_total{reason}`: requests refused because they may crash a process
  (`POISON_REASONS`): "compile_crash", an output constraint that crashed the front end's
  grammar sandbox or ran past its time (`deploy/openai/grammar_sandbox.py`); "intake", one
  whose rank died while taking it in; "rank_deaths", one running on two ranks as they died
  (`shoal.client.routing.migration`). Per front end: `sum` over targets.

Labels: `model_name` (the served model name), `engine` (the DP rank), and those named above.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shoal.client.api.outputs import RequestMetrics
from shoal.client.routing.lb_policy import REASONS
from shoal.client.routing.migration import FAILED_REASONS, MIGRATED_REASONS
from shoal.client.routing.migration import POISON_REASONS as MIGRATION_POISON_REASONS
from shoal.client.routing.router import RoutingStats
from shoal.deploy.cluster_metrics import ClusterCollector, ClusterFacts
from shoal.deploy.lora_metrics import LoRACollector
from shoal.engine.config import CacheConfig
from shoal.engine.protocol import ITERATION_TOKENS_BUCKETS, EngineFacts, SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Counters and histograms without their `_created` series, as vLLM serves them: a timestamp per
# series doubles the output and no dashboard reads it.
disable_created_metrics()

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_SCALE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_SCALE_OUTCOMES = ("committed", "rolled_back", "unchanged", "drained")


def cache_config_labels(cache: CacheConfig, facts: EngineFacts) -> dict[str, str]:
    """The labels of a rank's `vllm:cache_config_info`, spelt as vLLM spells its values
    (`str()` of each: "True", "None"). The KV cache holds the model's dtype: "auto".
    `gpu_memory_utilization` only where it sizes the cache: a rank on a GPU."""
    labels = {
        "block_size": str(facts.block_size),
        "num_gpu_blocks": str(facts.num_kv_blocks),
        "num_gpu_blocks_override": str(cache.num_gpu_blocks_override),
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "cache_dtype": "auto",
        "kv_cache_memory_bytes": str(cache.kv_cache_memory_bytes),
    }
    if facts.device == "cuda":
        labels["gpu_memory_utilization"] = str(cache.gpu_memory_utilization)
    return labels


class _RankCollector(Collector):
    """Per-rank gauges and engine counters from the latest published stats."""

    def __init__(
        self, model_name: str, rank_stats: Callable[[], dict[int, SchedulerStats]]
    ) -> None:
        self._model_name = model_name
        self._rank_stats = rank_stats

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "running": GaugeMetricFamily(
                "vllm:num_requests_running", "Requests running on the rank.", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "vllm:num_requests_waiting", "Requests waiting on the rank.", labels=labels
            ),
            "kv": GaugeMetricFamily(
                "vllm:kv_cache_usage_perc", "KV cache usage, 1 = full.", labels=labels
            ),
            "preemptions": CounterMetricFamily(
                "vllm:num_preemptions", "Preemptions on the rank.", labels=labels
            ),
            "queries": CounterMetricFamily(
                "vllm:prefix_cache_queries", "Prompt tokens looked up.", labels=labels
            ),
            "hits": CounterMetricFamily(
                "vllm:prefix_cache_hits", "Prompt tokens found cached.", labels=labels
            ),
        }
        iteration_tokens = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Tokens computed per engine step.", labels=labels
        )
        for rank, stats in sorted(self._rank_stats().items()):
            values = [self._model_name, str(rank)]
            if stats.iteration_tokens_counts:  # an engine that reports them
                buckets = _cumulative_buckets(stats.iteration_tokens_counts)
                sum_value = stats.iteration_tokens_sum
                iteration_tokens.add_metric(values, buckets, sum_value)
            families["running"].add_metric(values, stats.num_running_reqs)
            families["waiting"].add_metric(values, stats.num_waiting_reqs)
            families["kv"].add_metric(values, stats.kv_cache_usage)
            families["preemptions"].add_metric(values, stats.num_preemptions_total)
            families["queries"].add_metric(values, stats.prefix_cache_queries_total)
            families["hits"].add_metric(values, stats.prefix_cache_hits_total)
        yield from families.values()
        yield iteration_tokens


def _cumulative_buckets(counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus's cumulative (le, count) buckets from per-bucket counts whose last entry is
    the overflow (`SchedulerStats.iteration_tokens_counts`)."""
    bounds = [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
    return list(zip(bounds, itertools.accumulate(counts), strict=True))


class _CacheConfigCollector(Collector):
    """`vllm:cache_config_info`: one series per rank, valued 1, its labels the cache config."""

    def __init__(
        self, model_name: str, cache_config: Callable[[], dict[int, dict[str, str]]]
    ) -> None:
        self._model_name = model_name
        self._cache_config = cache_config

    def collect(self) -> Iterator[Metric]:
        per_rank = self._cache_config()
        if not per_rank:
            return
        names = sorted({name for labels in per_rank.values() for name in labels})
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV cache configuration (always 1).",
            labels=["model_name", "engine", *names],
        )
        for rank, labels in sorted(per_rank.items()):
            values = [labels.get(name, "") for name in names]
            info.add_metric([self._model_name, str(rank), *values], 1)
        yield info


# The `reason` label of `shoal:poison_requests_total`.
POISON_COMPILE_CRASH = "compile_crash"
POISON_REASONS = (POISON_COMPILE_CRASH, *MIGRATION_POISON_REASONS)


class _PoisonCollector(Collector):
    """`shoal:poison_requests_total{reason}`, read at scrape time from their counters."""

    def __init__(self, model_name: str, poison_counts: Callable[[], Mapping[str, int]]) -> None:
        self._model_name = model_name
        self._poison_counts = poison_counts

    def collect(self) -> Iterator[Metric]:
        counts = self._poison_counts()
        family = CounterMetricFamily(
            "shoal:poison_requests",
            "Requests refused because they may crash a process, by why.",
            labels=["model_name", "reason"],
        )
        for reason in POISON_REASONS:
            family.add_metric([self._model_name, reason], counts.get(reason, 0))
        yield family


class _RoutingCollector(Collector):
    """This front end's routing decisions and predicted against actual prefix-cache hits."""

    def __init__(self, model_name: str, routing_stats: Callable[[], RoutingStats | None]) -> None:
        self._model_name = model_name
        self._routing_stats = routing_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._routing_stats()
        if stats is None:
            return  # one local engine: nothing is routed
        labels = ["model_name"]
        decisions = CounterMetricFamily(
            "shoal:routing_decisions",
            "Requests this front end routed, by why the rank won.",
            labels=[*labels, "reason"],
        )
        for reason in REASONS:
            decisions.add_metric([self._model_name, reason], stats.decisions.get(reason, 0))
        yield decisions
        for name, value, doc in (
            ("predicted", stats.predicted_hit_tokens, "the router expected the rank to hold"),
            ("actual", stats.actual_hit_tokens, "the engine found in its prefix cache"),
        ):
            family = CounterMetricFamily(
                f"shoal:routing_{name}_hit_tokens",
                f"Prompt tokens of routed requests {doc}.",
                labels=labels,
            )
            family.add_metric([self._model_name], value)
            yield family
        for name, counts, reasons, doc in (
            ("migrated", stats.migrated, MIGRATED_REASONS, "moved to another rank"),
            ("failed", stats.failed, FAILED_REASONS, "lost as their rank failed or left"),
        ):
            family = CounterMetricFamily(
                f"shoal:requests_{name}", f"Requests {doc}, by why.", labels=[*labels, "reason"]
            )
            for reason in reasons:
                family.add_metric([self._model_name, reason], counts.get(reason, 0))
            yield family


class ServerMetrics:
    """The registry one front end serves at /metrics; `observe_finished` feeds it."""

    def __init__(
        self,
        model_name: str,
        rank_stats: Callable[[], dict[int, SchedulerStats]],
        routing_stats: Callable[[], RoutingStats | None] = lambda: None,
        cache_config: Callable[[], dict[int, dict[str, str]]] = dict,
        poison_counts: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.cluster = ClusterFacts()
        self._add_request_counters(["model_name", "engine"])
        self._add_latency_histograms(["model_name", "engine"])
        self._add_scale_metrics()
        reg = self.registry
        reg.register(_RankCollector(model_name, rank_stats))
        reg.register(ClusterCollector(model_name, self.cluster))
        reg.register(_RoutingCollector(model_name, routing_stats))
        reg.register(_CacheConfigCollector(model_name, cache_config))
        reg.register(_PoisonCollector(model_name, poison_counts))
        reg.register(LoRACollector(model_name, rank_stats))

    def _add_request_counters(self, labels: list[str]) -> None:
        """Tokens and requests served, by rank."""
        reg = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of served requests.", labels, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated for served requests.", labels, registry=reg
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.routed = Counter(
            "shoal:requests_routed", "Requests this front end sent to each rank.", labels,
            registry=reg,
        )  # fmt: skip

    def _add_latency_histograms(self, labels: list[str]) -> None:
        """Each request's latencies and sizes, by rank."""
        reg = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time waiting in the engine.", _LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "First scheduled to first token (the prefill).",
            _LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "First scheduled to finished (prefill and decode).",
            _LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )

    def _add_scale_metrics(self) -> None:
        """The cluster's resizes, by outcome: every series there from the first scrape, at 0."""
        reg = self.registry
        scale_labels = ["model_name", "outcome"]
        self.scale_events = Counter(
            "shoal:scale_events", "Resizes of the cluster, by outcome.", scale_labels,
            registry=reg,
        )  # fmt: skip
        self.scale_duration = Histogram(
            "shoal:scale_duration_seconds", "How long a resize took, by outcome.", scale_labels,
            registry=reg, buckets=_SCALE_BUCKETS,
        )  # fmt: skip
        for outcome in _SCALE_OUTCOMES:
            self.scale_events.labels(self.model_name, outcome)
            self.scale_duration.labels(self.model_name, outcome)
        self._counted_scale_epochs: set[int] = set()

    def observe_scale_history(self, history: Iterable[Mapping[str, Any]]) -> None:
        """Counts the resizes of the registry's history (`status()["scale_history"]`, re-read
        before every scrape) that this front end has not counted yet.

        Epochs that fell out of the history are forgotten: it only grows at its end.
        """
        epochs = set()
        for event in history:
            epoch = int(event["epoch"])
            epochs.add(epoch)
            if epoch in self._counted_scale_epochs:
                continue
            labels = (self.model_name, str(event["outcome"]))
            self.scale_events.labels(*labels).inc()
            self.scale_duration.labels(*labels).observe(float(event["duration_s"]))
        self._counted_scale_epochs = epochs

    def observe_sequence(
        self,
        rank: int | None,
        *,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        finish_reason: str,
        metrics: RequestMetrics,
        count_prompt: bool = True,
    ) -> None:
        """Counts one finished sequence (one engine request).

        Inter-token latency is the sequence's mean gap, observed once per gap: the front end
        sees when the first and the last token arrived, not every token (a stream's deltas
        coalesce when the reader is behind).

        Args:
            count_prompt: add the prompt tokens to the counter (False for the 2nd..nth
                sequence of an `n > 1` request, whose prompt the usage bills once).
        """
        labels = (self.model_name, "" if rank is None else str(rank))
        if count_prompt:  # per request, as vLLM counts it, not per sequence
            self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
            self.request_prompt_tokens.labels(*labels).observe(num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(num_generation_tokens)
        self.request_success.labels(*labels, finish_reason).inc()
        self.routed.labels(*labels).inc()
        self.request_generation_tokens.labels(*labels).observe(num_generation_tokens)
        first, last = metrics.first_token_time, metrics.last_token_time
        if first is not None:
            self.ttft.labels(*labels).observe(first - metrics.arrival_time)
            if last is not None and num_generation_tokens > 1:
                gap = (last - first) / (num_generation_tokens - 1)
                itl = self.itl.labels(*labels)
                for _ in range(num_generation_tokens - 1):
                    itl.observe(gap)
        if metrics.finished_time is not None:
            self.e2e.labels(*labels).observe(metrics.finished_time - metrics.arrival_time)
        if metrics.queue_time is not None:
            self.queue_time.labels(*labels).observe(metrics.queue_time)
            # The engine's first scheduling, on the front end's clock: arrival + queue time.
            scheduled = metrics.arrival_time + metrics.queue_time
            if first is not None:
                self.prefill_time.labels(*labels).observe(max(0.0, first - scheduled))
            if metrics.finished_time is not None:
                inference = max(0.0, metrics.finished_time - scheduled)
                self.inference_time.labels(*labels).observe(inference)
        if first is not None and last is not None:
            self.decode_time.labels(*labels).observe(last - first)

    def render(self) -> bytes:
        return generate_latest(self.registry)
