"""What the scheduler asks about requests' LoRA adapters: an adapter's key, whether a waiting
request may join the running ones (at most `max_loras` distinct adapters run at once), and the
stats' LoRA fields. No torch."""

from __future__ import annotations

from typing import Any

from shoal.engine.lora.slots import AdapterKey, LoRASlots
from shoal.engine.request import Request


def lora_stats(
    slots: LoRASlots | None, running: list[Request], waiting: list[Request], load_s: float
) -> dict[str, Any]:
    """The stats' LoRA fields: live slots, the requests' adapters, loads and evictions so far,
    and `load_s`, the seconds the model's loads took."""
    if slots is None:
        return {}

    def names(requests: list[Request]) -> list[str]:
        return sorted({r.lora_request.lora_name for r in requests if r.lora_request})

    return {
        "lora_live": [name for name, _ in slots.live()],
        "lora_cached": [name for name, _ in slots.cached()],
        "lora_running": names(running),
        "lora_waiting": names(waiting),
        "num_lora_loads_total": slots.num_loads,
        "num_lora_evictions_total": slots.num_evictions,
        "lora_load_seconds_total": load_s,
        "max_loras": slots.num_slots,
    }


def adapter_key(request: Request) -> AdapterKey | None:
    """The adapter `request` runs with, as the slot tables key it."""
    lora = request.lora_request
    return None if lora is None else (lora.lora_name, lora.lora_path)


def has_lora_slot(request: Request, running: list[Request], max_loras: int | None) -> bool:
    """Whether `request` may run beside the running requests' adapters."""
    lora = request.lora_request
    if lora is None or max_loras is None:
        return True
    live = {adapter_key(r) for r in running} - {None}
    return adapter_key(request) in live or len(live) < max_loras
