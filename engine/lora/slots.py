"""`LoRASlots`: which adapter holds each of a rank's `max_loras` live slots, and which adapters
its CPU memory keeps (`max_cpu_loras`, least recently used out, never a live one). No torch:
the model's stacked A/B weights are indexed by the slots it hands out, and its CPU copies follow
`cached()`.

Eviction. When an adapter needs a slot and none is free, the least used one is pushed out:
each adapter counts the steps it ran in, every count halves each `HALF_LIFE_STEPS` steps, and
the lowest count goes first, ties to the least recently used. Least-recently-used
alone evicts a popular adapter that sat idle for a moment in favour of a one-off; under a
skewed popularity that churns the slots (`bench/lora.py`).

Every worker of a tensor-parallel rank keeps its own table, and so does the scheduler (for the
rank's stats): all see the same steps with adapters in the same order, and a step's adapters
are taken in sorted order, so every table gives an adapter the same slot without talking to the
others. Only steps that run an adapter move the table (a step of base requests alone reaches
the model with no LoRA part), and the counts are integers, so every copy decays alike.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# An adapter's identity on a rank: (name, path). A name reloaded from another path is another
# adapter (its KV prefix-cache entries differ too).
AdapterKey = tuple[str, str]

BASE_SLOT = -1  # a request without an adapter
HALF_LIFE_STEPS = 256  # steps with adapters after which every use count is halved


class LoRASlots:
    """Slot assignment for one step at a time.

    Args:
        num_slots: `max_loras`; a step never holds more distinct adapters (the scheduler's
            invariant).
        num_cpu: `max_cpu_loras` (at least `num_slots`); default: `num_slots`.
    """

    def __init__(self, num_slots: int, num_cpu: int | None = None) -> None:
        self.num_slots = num_slots
        self.num_cpu = max(num_slots, num_cpu or num_slots)
        self._cpu: OrderedDict[AdapterKey, None] = OrderedDict()  # least recently used first
        self._live: OrderedDict[AdapterKey, int] = OrderedDict()  # least recently used first
        self._uses: dict[AdapterKey, int] = {}  # steps each adapter ran in, decayed
        self._num_steps = 0  # steps with adapters, since the start
        self.num_loads = 0  # adapters put in a slot, since the start
        self.num_evictions = 0  # of those loads, the ones that pushed another adapter out

    def live(self) -> list[AdapterKey]:
        """The adapters now in slots, least recently used first."""
        return list(self._live)

    def cached(self) -> list[AdapterKey]:
        """The adapters kept in CPU memory (the live ones among them)."""
        return list(self._cpu)

    def assign(
        self, keys: Sequence[AdapterKey | None]
    ) -> tuple[list[int], list[tuple[int, AdapterKey]]]:
        """Slots for one step's requests.

        Args:
            keys: per request of the step, its adapter or None.

        Returns:
            Per request its slot (`BASE_SLOT` without an adapter), and the (slot, adapter)
            pairs that must be loaded before the step runs.
        """
        wanted = sorted({k for k in keys if k is not None})
        assert len(wanted) <= self.num_slots, (
            f"{len(wanted)} adapters in one step, only {self.num_slots} slots"
        )
        if wanted:
            self._tick()
        loads: list[tuple[int, AdapterKey]] = []
        for key in wanted:
            self._uses[key] = self._uses.get(key, 0) + 1
            self._cpu[key] = None
            self._cpu.move_to_end(key)
            if key in self._live:
                self._live.move_to_end(key)
                continue
            slot = self._free_slot(set(wanted))
            self._live[key] = slot
            loads.append((slot, key))
        while len(self._cpu) > self.num_cpu:
            oldest = next(k for k in self._cpu if k not in self._live)
            del self._cpu[oldest]
        self.num_loads += len(loads)
        return [BASE_SLOT if k is None else self._live[k] for k in keys], loads

    def _tick(self) -> None:
        """One more step with adapters: every `HALF_LIFE_STEPS`, the counts halve, and those of
        adapters no longer held anywhere that reach zero are dropped."""
        self._num_steps += 1
        if self._num_steps % HALF_LIFE_STEPS:
            return
        self._uses = {k: n // 2 for k, n in self._uses.items() if n > 1 or k in self._cpu}

    def forget(self, key: AdapterKey) -> None:
        """Drops an adapter from its slot and the CPU set (its load failed)."""
        self._live.pop(key, None)
        self._cpu.pop(key, None)
        self._uses.pop(key, None)

    def _free_slot(self, keep: set[AdapterKey]) -> int:
        taken = set(self._live.values())
        for slot in range(self.num_slots):
            if slot not in taken:
                return slot
        # min() keeps the first of equals: the least recently used of the least used.
        victim = min((k for k in self._live if k not in keep), key=lambda k: self._uses.get(k, 0))
        self.num_evictions += 1
        return self._live.pop(victim)
