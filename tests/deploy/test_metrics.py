"""`ServerMetrics` without a cluster: vLLM's names and labels, values from the stats and the
sequences it is fed, text that `prometheus_client`'s parser reads, and a Grafana dashboard
that only asks for series the front end publishes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.client.api.outputs import RequestMetrics
from shoal.client.routing.router import RoutingStats
from shoal.deploy.metrics import ServerMetrics, cache_config_labels
from shoal.engine.config import CacheConfig
from shoal.engine.protocol import EngineFacts, SchedulerStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "shoal-dashboard.json"


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _make() -> ServerMetrics:
    stats = {
        0: SchedulerStats(
            num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
            prefix_cache_queries_total=100, prefix_cache_hits_total=40, num_preemptions_total=2,
        ),
        1: SchedulerStats(num_running_reqs=0, kv_cache_usage=0.0,
                          iteration_tokens_counts=[5, 2, 0, 1] + [0] * 9 + [1],
                          iteration_tokens_sum=5 + 2 * 8 + 30 + 20000),
    }  # fmt: skip
    metrics = ServerMetrics("m", lambda: stats)
    metrics.cluster.ranks_by_state = {"ready": 2}
    metrics.cluster.num_clients = 3
    metrics.cluster.data_parallel_size = 2
    return metrics


def test_rank_series_come_from_the_latest_stats() -> None:
    samples = _samples(_make())
    rank0 = (("engine", "0"), ("model_name", "m"))
    assert samples[("vllm:num_requests_running", rank0)] == 3
    assert samples[("vllm:num_requests_waiting", rank0)] == 1
    assert samples[("vllm:kv_cache_usage_perc", rank0)] == 0.25
    assert samples[("vllm:prefix_cache_queries_total", rank0)] == 100
    assert samples[("vllm:prefix_cache_hits_total", rank0)] == 40
    assert samples[("vllm:num_preemptions_total", rank0)] == 2
    assert samples[("vllm:num_requests_running", (("engine", "1"), ("model_name", "m")))] == 0
    assert samples[("shoal:ranks", (("model_name", "m"), ("state", "ready")))] == 2
    assert samples[("shoal:attached_clients", (("model_name", "m"),))] == 3
    assert samples[("shoal:data_parallel_size", (("model_name", "m"),))] == 2
    assert samples[("shoal:scale_in_progress", (("model_name", "m"),))] == 0


def _scale_event(epoch: int, outcome: str, duration_s: float) -> dict[str, object]:
    return {"epoch": epoch, "from_size": 2, "to_size": 3, "outcome": outcome,
            "duration_s": duration_s, "detail": "", "finished_at": 0.0}  # fmt: skip


def test_each_resize_of_the_history_is_counted_once() -> None:
    metrics = _make()
    committed = (("model_name", "m"), ("outcome", "committed"))
    rolled_back = (("model_name", "m"), ("outcome", "rolled_back"))
    assert _samples(metrics)[("shoal:scale_events_total", committed)] == 0  # there from the start
    history = [_scale_event(1, "committed", 4.0), _scale_event(2, "rolled_back", 30.0)]
    for _ in range(3):  # the history is re-read before every scrape
        metrics.observe_scale_history(history)
    history.append(_scale_event(3, "committed", 6.0))
    metrics.observe_scale_history(history[1:])  # epoch 1 fell out of the registry's window
    metrics.observe_scale_history(history[1:])
    metrics.cluster.is_scaling = True
    samples = _samples(metrics)
    assert samples[("shoal:scale_events_total", committed)] == 2
    assert samples[("shoal:scale_events_total", rolled_back)] == 1
    assert samples[("shoal:scale_duration_seconds_count", committed)] == 2
    assert samples[("shoal:scale_duration_seconds_sum", committed)] == 10.0
    assert samples[("shoal:scale_duration_seconds_bucket", (("le", "5.0"), *committed))] == 1
    assert samples[("shoal:scale_in_progress", (("model_name", "m"),))] == 1
    # A front end that starts later counts what the registry still keeps: the same totals.
    later = _make()
    later.observe_scale_history(history)
    later_samples = _samples(later)
    for key in (("shoal:scale_events_total", committed), ("shoal:scale_events_total", rolled_back)):
        assert later_samples[key] == samples[key]


def test_finished_sequences_feed_counters_and_histograms() -> None:
    metrics = _make()
    timing = RequestMetrics(
        arrival_time=100.0, first_token_time=100.5, last_token_time=101.5, finished_time=101.5,
        queue_time=0.2,
    )  # fmt: skip
    for index in range(2):  # one request with n=2: its prompt is billed once
        metrics.observe_sequence(
            1, num_prompt_tokens=7, num_generation_tokens=5, finish_reason="length",
            metrics=timing, count_prompt=index == 0,
        )  # fmt: skip
    metrics.observe_sequence(
        0, num_prompt_tokens=3, num_generation_tokens=1, finish_reason="stop", metrics=timing
    )
    samples = _samples(metrics)
    rank1 = (("engine", "1"), ("model_name", "m"))
    assert samples[("vllm:prompt_tokens_total", rank1)] == 7
    assert samples[("vllm:request_prompt_tokens_count", rank1)] == 1  # n=2: one request
    assert samples[("vllm:request_prompt_tokens_sum", rank1)] == 7
    # Scheduled at 100.2 (arrival + queue), first token 100.5, last and finished 101.5.
    assert samples[("vllm:request_prefill_time_seconds_sum", rank1)] == pytest.approx(0.6)
    assert samples[("vllm:request_decode_time_seconds_sum", rank1)] == pytest.approx(2.0)
    assert samples[("vllm:request_inference_time_seconds_sum", rank1)] == pytest.approx(2.6)
    assert not any(name.endswith("_created") for name, _ in samples)
    assert samples[("vllm:generation_tokens_total", rank1)] == 10
    assert samples[("vllm:request_success_total", (*rank1[:1], ("finished_reason", "length"),
                                                   rank1[1]))] == 2  # fmt: skip
    assert samples[("shoal:requests_routed_total", rank1)] == 2
    assert samples[("vllm:time_to_first_token_seconds_sum", rank1)] == 1.0
    assert samples[("vllm:e2e_request_latency_seconds_count", rank1)] == 2
    assert samples[("vllm:request_queue_time_seconds_sum", rank1)] == 0.4
    # 4 gaps of 0.25 s per 5-token sequence; a 1-token sequence has none.
    assert samples[("vllm:inter_token_latency_seconds_count", rank1)] == 8
    assert samples[("vllm:inter_token_latency_seconds_sum", rank1)] == 2.0
    rank0 = (("engine", "0"), ("model_name", "m"))
    assert samples.get(("vllm:inter_token_latency_seconds_count", rank0), 0) == 0
    assert samples[("vllm:request_generation_tokens_sum", rank0)] == 1


def test_the_dashboard_asks_only_for_published_series() -> None:
    metrics = _make()
    metrics.observe_sequence(
        0, num_prompt_tokens=1, num_generation_tokens=2, finish_reason="stop",
        metrics=RequestMetrics(0.0, 0.1, 0.2, 0.2, 0.0),
    )  # fmt: skip
    published = {name for name, _ in _samples(metrics)}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\b((?:vllm|shoal):[a-z0-9_]+)", e)}
    assert wanted and wanted <= published, wanted - published
    assert {"vllm:num_requests_running", "vllm:time_to_first_token_seconds_bucket"} <= wanted
    assert {"shoal:scale_events_total", "shoal:data_parallel_size"} <= wanted


def test_routing_series_come_from_the_router() -> None:
    routing = RoutingStats(decisions={"cache": 5, "load": 2}, predicted_hit_tokens=640)
    routing.actual_hit_tokens = 624
    metrics = ServerMetrics("m", dict, lambda: routing)
    samples = _samples(metrics)
    model = (("model_name", "m"),)
    assert samples[("shoal:routing_decisions_total", (*model, ("reason", "cache")))] == 5
    assert samples[("shoal:routing_decisions_total", (*model, ("reason", "load")))] == 2
    assert samples[("shoal:routing_decisions_total", (*model, ("reason", "session")))] == 0
    assert samples[("shoal:routing_predicted_hit_tokens_total", model)] == 640
    assert samples[("shoal:routing_actual_hit_tokens_total", model)] == 624
    # One local engine routes nothing: no routing series at all.
    assert not any(name.startswith("shoal:routing") for name, _ in _samples(_make()))


def test_migration_series_count_moves_and_losses_by_reason() -> None:
    routing = RoutingStats(migrated={"rank_failed": 3, "resize": 1}, failed={"pinned": 2})
    samples = _samples(ServerMetrics("m", dict, lambda: routing))
    model = ("model_name", "m")
    migrated, failed = "shoal:requests_migrated_total", "shoal:requests_failed_total"
    assert samples[(migrated, (model, ("reason", "rank_failed")))] == 3
    assert samples[(migrated, (model, ("reason", "resize")))] == 1
    assert samples[(failed, (model, ("reason", "pinned")))] == 2
    assert samples[(failed, (model, ("reason", "migration_limit")))] == 0
    assert samples[(failed, (model, ("reason", "no_rank")))] == 0


def test_cache_config_info_labels_each_rank_with_its_kv_cache() -> None:
    cache = CacheConfig(block_size=32, enable_prefix_caching=False, num_gpu_blocks_override=64)
    facts = {
        rank: EngineFacts(rank, b"id", "model", 256, num_kv_blocks, 32, 100, device=device)
        for rank, num_kv_blocks, device in ((0, 64, "cpu"), (1, 48, "cuda"))
    }
    metrics = ServerMetrics(
        "m", dict, cache_config=lambda: {r: cache_config_labels(cache, f) for r, f in facts.items()}
    )
    samples = {
        labels: value
        for (name, labels), value in _samples(metrics).items()
        if name == "vllm:cache_config_info"
    }
    assert len(samples) == 2 and set(samples.values()) == {1.0}
    rank1 = dict(next(labels for labels in samples if ("engine", "1") in labels))
    assert rank1 == {
        "model_name": "m", "engine": "1", "block_size": "32", "num_gpu_blocks": "48",
        "num_gpu_blocks_override": "64", "enable_prefix_caching": "False", "cache_dtype": "auto",
        "gpu_memory_utilization": "0.9", "kv_cache_memory_bytes": "None",
    }  # fmt: skip
    # A rank on a CPU: its cache is sized in bytes, and no GPU share is claimed (an empty
    # label is an absent one); a cluster of CPU ranks has no such label at all.
    rank0 = dict(next(labels for labels in samples if ("engine", "0") in labels))
    assert rank0["gpu_memory_utilization"] == "" and rank0["kv_cache_memory_bytes"] == "None"
    cpu_only = ServerMetrics(
        "m", dict, cache_config=lambda: {0: cache_config_labels(cache, facts[0])}
    )
    text = cpu_only.render()
    assert b"vllm:cache_config_info{" in text and b"gpu_memory_utilization" not in text
    # No rank attached (a front end between clusters): no series.
    assert b"vllm:cache_config_info{" not in ServerMetrics("m", dict).render()


def test_iteration_tokens_are_each_ranks_steps_in_vllms_buckets() -> None:
    samples = _samples(_make())
    rank1 = (("engine", "1"), ("model_name", "m"))

    def bucket(le: str) -> float:
        return samples[("vllm:iteration_tokens_total_bucket", (*rank1[:1], ("le", le), rank1[1]))]

    assert [bucket(le) for le in ("1.0", "8.0", "16.0", "32.0", "16384.0", "+Inf")] == [
        5, 7, 7, 8, 8, 9,
    ]  # fmt: skip
    assert samples[("vllm:iteration_tokens_total_count", rank1)] == 9
    assert samples[("vllm:iteration_tokens_total_sum", rank1)] == 5 + 16 + 30 + 20000
    # Rank 0's engine reported none: no series rather than zeros that were never measured.
    assert not any(
        name.startswith("vllm:iteration_tokens") and ("engine", "0") in labels
        for name, labels in samples
    )
