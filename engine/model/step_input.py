"""`StepInput`: one engine step as every worker of a rank needs it — the flat token batch, where
each request's KV goes, and which rows sample — and `plan_step`, which builds it from the
scheduler's output.

It is what the driver worker broadcasts to the other workers of a tensor-parallel rank each
step (`shoal.engine.model.multiproc_executor`), so it is a msgspec struct of plain lists: no
`Request` objects, no sampling state (only the driver samples). Order: decodes (one new token)
first, longest context first, then the prefill chunks, as the attention backends expect.
"""

from __future__ import annotations

import msgspec

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
    """

    starts: list[int]
    num_new_tokens: list[int]
    token_ids: list[int]
    block_ids: list[list[int]]
    sample_rows: list[int]

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


def plan_step(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[StepInput, list[Request]]:
    """The step's batch and the requests that sample in it (in `sample_rows` order).

    Args:
        scheduler_output: a non-empty step; its requests' `num_computed_tokens` not yet advanced.
        block_size: tokens per KV block.
    """
    batch = order_batch(scheduler_output.scheduled)
    starts, num_new, token_ids, block_ids, sample_rows = [], [], [], [], []
    samplers: list[Request] = []
    for s in batch:
        start, n = s.start, s.num_new_tokens
        num_blocks = (start + n - 1) // block_size + 1
        assert len(s.block_ids) >= num_blocks, (
            f"{s.request.request_id}: blocks do not cover the chunk"
        )
        starts.append(start)
        num_new.append(n)
        token_ids.extend(s.request.all_token_ids[start : start + n])
        block_ids.append(list(s.block_ids[:num_blocks]))
        if s.samples:
            sample_rows.append(len(token_ids) - 1)
            samplers.append(s.request)
    return StepInput(starts, num_new, token_ids, block_ids, sample_rows), samplers


def order_batch(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes (one new token) first, longest context first, then the prefill chunks."""
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    decodes.sort(key=lambda s: s.start, reverse=True)
    return decodes + [s for s in scheduled if s.num_new_tokens != 1]
