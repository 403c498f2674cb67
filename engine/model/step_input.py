"""`StepInput`: one engine step as every worker of a rank needs it — the flat token batch, where
each request's KV goes, and which rows sample — and `plan_step`, which builds it from the
scheduler's output.

It is what the driver worker broadcasts to the other workers of a tensor-parallel rank each
step (`shoal.engine.model.multiproc_executor`), so it is a msgspec struct of plain lists: no
`Request` objects, no sampling state (only the driver samples). Order: decodes (one new token)
first, longest context first, then the prefill chunks, as the attention backends expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from shoal.engine.protocol import LoRARequest
from shoal.engine.request import Request
from shoal.engine.scheduler_output import ScheduledRequest, SchedulerOutput


class StepInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's batch, in batch order.

    Attributes:
        starts: per request, tokens already in its KV cache (its first new position).
        num_new_tokens: per request, the tokens computed this step.
        token_ids: the step's input tokens, all requests' chunks one after another.
        block_ids: per request, the KV blocks covering its context after this step.
        sample_rows: rows of the batch whose logits are sampled, one per sampling request, in
            the order of the driver's `samplers`.
        lora_requests: per request, the LoRA adapter it runs with (or None); empty when no
            request of the step has one.
    """

    starts: list[int]
    num_new_tokens: list[int]
    token_ids: list[int]
    block_ids: list[list[int]]
    sample_rows: list[int]
    lora_requests: list[LoRARequest | None] = msgspec.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_decodes(self) -> int:
        """How many leading requests compute exactly one token."""
        count = 0
        for n in self.num_new_tokens:
            if n != 1:
                break
            count += 1
        return count


@dataclass(frozen=True)
class PoolChunk:
    """A pooling request's rows in a step's batch (the driver's; never sent to workers).

    Attributes:
        request: the pooling request.
        first_row: its chunk's first row in the batch.
        num_rows: the chunk's tokens.
        is_first: the chunk starts at the prompt's first token (a recompute starts afresh).
        is_last: the chunk ends at the prompt's last token: the request pools now.
    """

    request: Request
    first_row: int
    num_rows: int
    is_first: bool
    is_last: bool


def plan_step(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[StepInput, list[Request], list[PoolChunk]]:
    """The step's batch, the requests that sample in it (in `sample_rows` order), and the
    chunks of pooling requests (which never sample).

    Args:
        scheduler_output: a non-empty step; its requests' `num_computed_tokens` not yet advanced.
        block_size: tokens per KV block.
    """
    batch = order_batch(scheduler_output.scheduled)
    starts: list[int] = []
    num_new: list[int] = []
    token_ids: list[int] = []
    block_ids: list[list[int]] = []
    sample_rows: list[int] = []
    samplers: list[Request] = []
    poolers: list[PoolChunk] = []
    for s in batch:
        start, n = s.start, s.num_new_tokens
        num_blocks = (start + n - 1) // block_size + 1
        assert len(s.block_ids) >= num_blocks, (
            f"{s.request.request_id}: blocks do not cover the chunk"
        )
        starts.append(start)
        num_new.append(n)
        first_row = len(token_ids)
        token_ids.extend(s.request.all_token_ids[start : start + n])
        block_ids.append(list(s.block_ids[:num_blocks]))
        if s.request.is_pooling:
            poolers.append(PoolChunk(s.request, first_row, n, start == 0, s.samples))
        elif s.samples:
            sample_rows.append(len(token_ids) - 1)
            samplers.append(s.request)
    loras = [s.request.lora_request for s in batch]
    lora_requests = loras if any(lora is not None for lora in loras) else []
    step = StepInput(starts, num_new, token_ids, block_ids, sample_rows, lora_requests)
    return step, samplers, poolers


def order_batch(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes (one new token) first, longest context first, then the prefill chunks."""
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    decodes.sort(key=lambda s: s.start, reverse=True)
    return decodes + [s for s in scheduled if s.num_new_tokens != 1]
