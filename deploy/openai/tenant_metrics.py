"""Per-tenant series of one front end's `/metrics`, read from its admission at scrape time.

    shoal:tenant_requests_admitted_total{tenant}         requests admitted (now or after waiting)
    shoal:tenant_requests_queued_total{tenant}           of the requests offered, those that waited
    shoal:tenant_requests_rejected_total{tenant,reason}  429s (tenant_queue_full) and 503s
                                                         (front_end_full)
    shoal:tenant_admitted_tokens_total{tenant}           work admitted: prompt + expected output
    shoal:tenant_prompt_tokens_total{tenant}             tokens served, as vLLM counts them
    shoal:tenant_generation_tokens_total{tenant}
    shoal:tenant_requests_waiting{tenant}                gauges: waiting now, in flight now,
    shoal:tenant_requests_in_flight{tenant}              and the work in flight now
    shoal:tenant_in_flight_tokens{tenant}
    shoal:tenant_queue_time_seconds{tenant}              histogram: the wait of each request
                                                         admitted after waiting
    shoal:admission_capacity_tokens, ..._seqs            what this front end admits into now

Like the other request series, each front end counts its own: `sum` over targets.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shoal.deploy.openai.admission import REJECT_REASONS
from shoal.deploy.openai.admission_gate import AdmissionGate

QUEUE_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class QueueTimes:
    """Each tenant's admission waits, in `QUEUE_TIME_BUCKETS` (the last count: over all)."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, tenant: str, waited_s: float) -> None:
        counts = self.counts.setdefault(tenant, [0] * (len(QUEUE_TIME_BUCKETS) + 1))
        counts[bisect.bisect_left(QUEUE_TIME_BUCKETS, waited_s)] += 1
        self.sums[tenant] = self.sums.get(tenant, 0.0) + waited_s


class TenantCollector(Collector):
    """The series of the module docstring for one front end."""

    def __init__(
        self, model_name: str, gate: Callable[[], AdmissionGate], queue_times: QueueTimes
    ) -> None:
        self._model_name = model_name
        self._gate = gate
        self._queue_times = queue_times

    def collect(self) -> Iterator[Metric]:
        gate = self._gate()
        policy = gate.policy
        labels = ["model_name", "tenant"]
        families = {
            name: CounterMetricFamily(f"shoal:tenant_{name}", doc, labels=labels)
            for name, doc in (
                ("requests_admitted", "Requests admitted."),
                ("requests_queued", "Requests that waited for admission."),
                ("admitted_tokens", "Work admitted: prompt plus expected output tokens."),
                ("prompt_tokens", "Prompt tokens served."),
                ("generation_tokens", "Tokens generated."),
            )
        }
        gauges = {
            name: GaugeMetricFamily(f"shoal:tenant_{name}", doc, labels=labels)
            for name, doc in (
                ("requests_waiting", "Requests waiting for admission now."),
                ("requests_in_flight", "Requests admitted and not finished."),
                ("in_flight_tokens", "Work in flight: prompt plus expected output tokens."),
            )
        }
        rejected = CounterMetricFamily(
            "shoal:tenant_requests_rejected", "Requests refused.", labels=[*labels, "reason"]
        )
        for tenant in policy.tenant_names():
            view = policy.tenant_view(tenant)
            values = [self._model_name, tenant]
            prompt, generation = gate.usage.get(tenant, (0, 0))
            for name, value in (
                ("requests_admitted", view.stats.num_admitted),
                ("requests_queued", view.stats.num_queued),
                ("admitted_tokens", view.stats.num_tokens_admitted),
                ("prompt_tokens", prompt),
                ("generation_tokens", generation),
            ):
                families[name].add_metric(values, value)
            gauges["requests_waiting"].add_metric(values, view.num_queued)
            gauges["requests_in_flight"].add_metric(values, view.num_in_flight)
            gauges["in_flight_tokens"].add_metric(values, view.in_flight_tokens)
            for reason in REJECT_REASONS:
                rejected.add_metric([*values, reason], view.stats.num_rejected.get(reason, 0))
        yield from families.values()
        yield from gauges.values()
        yield rejected
        yield self._queue_time_family()
        yield from self._capacity_families(gate)

    def _queue_time_family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "shoal:tenant_queue_time_seconds",
            "Seconds a request waited for admission.",
            labels=["model_name", "tenant"],
        )
        bounds = [str(float(b)) for b in QUEUE_TIME_BUCKETS] + ["+Inf"]
        for tenant, counts in sorted(self._queue_times.counts.items()):
            buckets = list(zip(bounds, itertools.accumulate(counts), strict=True))
            family.add_metric([self._model_name, tenant], buckets, self._queue_times.sums[tenant])
        return family

    def _capacity_families(self, gate: AdmissionGate) -> Iterator[Metric]:
        capacity = gate.policy.capacity
        for name, value, doc in (
            ("tokens", capacity.num_tokens, "KV tokens this front end admits work into."),
            ("seqs", capacity.num_seqs, "Sequences this front end admits work into."),
        ):
            family = GaugeMetricFamily(
                f"shoal:admission_capacity_{name}", doc, labels=["model_name"]
            )
            family.add_metric([self._model_name], value)
            yield family
