"""LoRA series of `/metrics`, from the ranks' published stats: vLLM's `vllm:lora_requests_info`
(per rank, labelled with its slots and the adapters its running and waiting requests run with;
value 1), and per rank `shoal:lora_adapter_loads_total` (adapters put in a slot),
`shoal:lora_adapter_evictions_total` (of those, the loads that pushed another adapter out) and
`shoal:lora_adapter_load_seconds_total` (the time loads took). Ranks without LoRA publish
none."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.engine.protocol import SchedulerStats


class LoRACollector(Collector):
    """Reads the latest stats of each rank at scrape time."""

    def __init__(
        self, model_name: str, rank_stats: Callable[[], dict[int, SchedulerStats]]
    ) -> None:
        self._model_name = model_name
        self._rank_stats = rank_stats

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "The rank's LoRA slots and the adapters of its running and waiting requests.",
            labels=[
                "model_name", "engine", "max_lora", "running_lora_adapters",
                "waiting_lora_adapters",
            ],
        )  # fmt: skip
        loads = CounterMetricFamily(
            "shoal:lora_adapter_loads",
            "LoRA adapters put in a slot of the rank.",
            labels=["model_name", "engine"],
        )
        evictions = CounterMetricFamily(
            "shoal:lora_adapter_evictions",
            "LoRA adapters pushed out of the rank's slots by a load.",
            labels=["model_name", "engine"],
        )
        load_seconds = CounterMetricFamily(
            "shoal:lora_adapter_load_seconds",
            "Seconds the rank spent putting LoRA adapters in slots.",
            labels=["model_name", "engine"],
        )
        for rank, stats in sorted(self._rank_stats().items()):
            if not stats.max_loras:
                continue
            running, waiting = ",".join(stats.lora_running), ",".join(stats.lora_waiting)
            values = [self._model_name, str(rank)]
            info.add_metric([*values, str(stats.max_loras), running, waiting], 1.0)
            loads.add_metric(values, stats.num_lora_loads_total)
            evictions.add_metric(values, stats.num_lora_evictions_total)
            load_seconds.add_metric(values, stats.lora_load_seconds_total)
        yield from (info, loads, evictions, load_seconds)
