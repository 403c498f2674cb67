"""`LoRAModel`: a model's LoRA serving state on one worker — a `LoRAStack` on every adaptable
projection, the slot table, and the step's grouping of rows by adapter.

Each step, the adapters of the step's requests get slots (`LoRASlots`: the least used out);
an adapter new to its slot is read from its folder and written in, narrowed to this worker's
shard (column-parallel projections: B's output rows; row-parallel: A's input columns) with B
scaled by alpha/r. An adapter's tensors are read from disk once and kept in CPU memory while
`LoRASlots.cached()` holds it (`max_cpu_loras`); one that enters a slot again from there is
not read again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from shoal.engine.lora.adapter import AdapterSpec, check_adapter, read_adapter_weights
from shoal.engine.lora.config import LoRAConfig
from shoal.engine.lora.slots import AdapterKey, LoRASlots
from shoal.engine.model.layers import Linear, LoRATargets
from shoal.engine.model.lora_layers import LoRABatch, LoRAStack
from shoal.engine.protocol import LoRARequest

# Module name → (A, B), as the adapter's file holds them.
_Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRAModel:
    """Attaches LoRA stacks to a loaded model's adaptable projections.

    Args:
        targets: the model's `lora_targets()`.
        config: the engine's LoRA limits.
        dtype, device: the model's.
    """

    def __init__(
        self, targets: LoRATargets, config: LoRAConfig, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.targets = targets
        self.max_rank = config.max_lora_rank
        self.slots = LoRASlots(config.max_loras, config.num_cpu_loras)
        self._cpu: dict[AdapterKey, tuple[AdapterSpec, _Weights]] = {}
        self.num_disk_reads = 0  # adapters read from their folders
        self.step_load_s = 0.0  # the seconds the last `prepare`'s loads took
        self.batch = LoRABatch(device)
        self.dtype = dtype
        parts: dict[Linear, int] = {}
        for target in targets.values():
            parts[target.linear] = target.num_parts
        self.stacks: dict[Linear, LoRAStack] = {}
        for linear, num_parts in parts.items():
            stack = LoRAStack(
                self.batch,
                num_slots=config.max_loras,
                num_parts=num_parts,
                max_rank=config.max_lora_rank,
                in_features=linear.in_features,
                out_features=linear.out_features,
                dtype=dtype,
                device=device,
            )
            linear.lora = stack
            self.stacks[linear] = stack

    def check(self, path: str) -> AdapterSpec:
        """Checks an adapter folder against this model (see `check_adapter`).

        Raises:
            AdapterError: what does not fit.
        """
        shapes = {name: t.full_shape for name, t in self.targets.items()}
        return check_adapter(path, shapes, self.max_rank)

    def prepare(
        self, lora_requests: Sequence[LoRARequest | None], num_new_tokens: Sequence[int]
    ) -> dict[AdapterKey, str]:
        """Puts a step's adapters in slots and groups its rows by slot.

        Args:
            lora_requests: per request of the step, its adapter or None; empty: none at all.
            num_new_tokens: per request, its rows in the batch.

        Returns:
            The adapters that could not be loaded (their folder changed since their requests
            were checked), and why: their slots stay zero and are given up.
        """
        self.step_load_s = 0.0
        if not lora_requests:
            self.batch.clear()
            return {}
        keys: list[AdapterKey | None] = [
            None if r is None else (r.lora_name, r.lora_path) for r in lora_requests
        ]
        slots, loads = self.slots.assign(keys)
        failures: dict[AdapterKey, str] = {}
        started = time.perf_counter()
        for slot, key in loads:
            try:
                self._load(slot, key)
            except Exception as e:  # whatever the folder holds now: its requests fail, not the step
                failures[key] = f"the LoRA adapter {key[0]!r} could not be loaded: {e}"
                for stack in self.stacks.values():
                    stack.clear(slot)
                self.slots.forget(key)
        if loads:
            self.step_load_s = time.perf_counter() - started
        kept = set(self.slots.cached())
        self._cpu = {key: w for key, w in self._cpu.items() if key in kept}
        self.batch.set_token_slots(np.repeat(np.asarray(slots), np.asarray(num_new_tokens)))
        return failures

    def _load(self, slot: int, key: AdapterKey) -> None:
        if key not in self._cpu:
            self._cpu[key] = (self.check(key[1]), read_adapter_weights(key[1]))
            self.num_disk_reads += 1
        spec, weights = self._cpu[key]
        for stack in self.stacks.values():
            stack.clear(slot)
        for module, (a, b) in weights.items():
            target = self.targets[module]
            if target.in_cols is not None:
                a = target.in_cols.narrow(a, 1)
            b = target.out_rows.narrow(b, 0) * spec.scaling
            stack = self.stacks[target.linear]
            stack.load(slot, target.part, a.to(self.dtype), b.to(self.dtype), target.out_start)
