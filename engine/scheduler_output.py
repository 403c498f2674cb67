"""The scheduler → model runner contract, and the runner's answer. No torch here.

One engine step is: `Scheduler.schedule()` → `SchedulerOutput` → `ModelRunner.execute_model()` →
`ModelRunnerOutput` → `Scheduler.update_from_output()`. The runner only reads requests; all
state changes happen in the scheduler, after the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.engine.protocol import TokenLogprobs
from shoal.engine.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes KV for `request.all_token_ids[start : start + num_new_tokens]` where
    `start = request.num_computed_tokens` (not yet advanced), writing it into `block_ids`,
    which cover at least `start + num_new_tokens` slots. Tokens before `start` are already in
    those blocks (computed earlier, or found in the prefix cache).
    """

    request: Request
    num_new_tokens: int
    block_ids: Sequence[int]

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """All requests in one step, decodes first, then prefill chunks (the order is a hint only).

    `finished_request_ids` lists requests that ended since the previous step, so a runner that
    caches per-request state (sampler generators, persistent batch rows) can drop it.
    """

    scheduled: list[ScheduledRequest]
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for the requests whose chunk `samples`, keyed by request id; for a
    pooling request whose chunk reaches its prompt's end, its pooled vector instead."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # LoRA adapters (name, path) that could not be loaded this step, and why: their requests
    # fail (their rows ran with a zeroed slot); the others are unaffected.
    lora_errors: dict[tuple[str, str], str] = field(default_factory=dict)
    # The seconds this step spent putting adapters in slots (the driver worker's).
    lora_load_s: float = 0.0
