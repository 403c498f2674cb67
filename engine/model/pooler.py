"""`Pooler`: a pooling engine's answer to a prompt — its final hidden states (after the model's
last norm) pooled into one vector, as vLLM's `--runner pooling --convert embed` does.

LAST takes the state of the prompt's last token; MEAN averages the states of every prompt
token, summed chunk by chunk as chunked prefill computes them (the engine turns the prefix
cache off for MEAN: cached tokens would have no states). A chunk that starts the prompt resets
the sum (a preempted request computes it again from the start); sums of requests that ended
before their last chunk (aborted) are dropped at the next call. The vector is L2-normalised
unless the request or `--pooler-config` says otherwise. It reads requests, never changes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.engine.config import PoolerConfig
from shoal.engine.model.step_input import PoolChunk
from shoal.engine.request import Request


class Pooler:
    """Pools the rows of one step's pooling chunks.

    Args:
        config: the pooling type and the default normalisation.
    """

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        # MEAN: request id -> (request, sum of its states so far, their number).
        self._sums: dict[str, tuple[Request, torch.Tensor, int]] = {}

    def pool(self, chunks: Sequence[PoolChunk], hidden: torch.Tensor) -> dict[str, list[float]]:
        """The pooled vector of each request whose last chunk is in this step.

        Args:
            chunks: the step's pooling chunks (`plan_step`).
            hidden: the step's final hidden states, [num_tokens, hidden_size].
        """
        self._sums = {k: v for k, v in self._sums.items() if not v[0].is_finished}
        pooled: dict[str, list[float]] = {}
        for chunk in chunks:
            vector = self._add(chunk, hidden[chunk.first_row : chunk.first_row + chunk.num_rows])
            if vector is not None:
                pooled[chunk.request.request_id] = self._finish(chunk.request, vector)
        return pooled

    def _add(self, chunk: PoolChunk, rows: torch.Tensor) -> torch.Tensor | None:
        """Takes in one chunk's states; the request's pooled (not normalised) vector once its
        last chunk is in."""
        if self.config.pooling_type == "LAST":
            return rows[-1].float() if chunk.is_last else None
        request_id = chunk.request.request_id
        total, count = rows.float().sum(dim=0), chunk.num_rows
        if not chunk.is_first:
            assert request_id in self._sums, f"{request_id}: a later chunk came without the first"
            _, earlier, num_earlier = self._sums[request_id]
            total, count = total + earlier, count + num_earlier
        if not chunk.is_last:
            self._sums[request_id] = (chunk.request, total, count)
            return None
        self._sums.pop(request_id, None)
        return total / count

    def _finish(self, request: Request, vector: torch.Tensor) -> list[float]:
        params = request.pooling_params
        normalize = params.use_activation if params is not None else None
        if self.config.use_activation if normalize is None else normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        values: list[float] = vector.cpu().tolist()
        return values
