"""The LoRA side of a projection: every live adapter's A and B stacked in fixed slots
(`LoRAStack`), and the step's grouping of token rows by slot that all stacks share
(`LoRABatch`).

A projection with P adaptable parts (fused qkv: 3, fused gate_up: 2, others: 1) stacks, per
slot, A as [P·R, in] (part p in rows p·R..) and B as [out, P·R] with part p's block in its own
output rows and columns p·R.. (zero elsewhere), so one pair of matmuls serves every part, and
ranks below R are zero-padded. Knows nothing of adapter files or requests.
"""

from __future__ import annotations

import numpy as np
import torch


class LoRABatch:
    """The step's token rows grouped by adapter slot, shared by every `LoRAStack` of a model.

    `groups` holds (slot, rows) per adapter present in the step, rows None when every token
    of the step is that adapter's; tokens of base requests appear in no group.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def set_token_slots(self, token_slots: np.ndarray) -> None:
        """Groups a step's rows by slot (-1: no adapter); one group per distinct slot."""
        slots = np.unique(token_slots[token_slots >= 0])
        if len(slots) == 1 and bool((token_slots == slots[0]).all()):
            self.groups = [(int(slots[0]), None)]
            return
        self.groups = [
            (int(s), torch.from_numpy(np.flatnonzero(token_slots == s)).to(self.device))
            for s in slots
        ]

    def clear(self) -> None:
        self.groups = []


class LoRAStack:
    """One projection's adapters: y += (x Aᵀ) Bᵀ per slot, over that slot's rows only.

    Args:
        batch: the model's shared `LoRABatch`.
        num_slots: `max_loras`.
        num_parts: the projection's fused parts.
        max_rank: `max_lora_rank` (R).
        in_features, out_features: this worker's shard of the projection.
    """

    def __init__(
        self,
        batch: LoRABatch,
        *,
        num_slots: int,
        num_parts: int,
        max_rank: int,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.max_rank = max_rank
        width = num_parts * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each of the step's adapters' update on its own rows (in place)."""
        for slot, rows in self.batch.groups:
            a, b = self.a[slot], self.b[slot]
            if rows is None:
                y.add_((x @ a.T) @ b.T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, out_start: int) -> None:
        """Writes one part's A [r, in] and (scaled) B [rows, r] into `slot`; B's rows start at
        `out_start` of this projection's output."""
        rank = a.shape[0]
        assert rank <= self.max_rank, f"rank {rank} over the stack's {self.max_rank}"
        col = part * self.max_rank
        self.a[slot, col : col + rank].copy_(a)
        self.b[slot, out_start : out_start + b.shape[0], col : col + rank].copy_(b)
