"""`LoRASlots`: least recently used adapters leave the slots and the CPU set, the live ones are
always in the CPU set, and a step's order of requests does not change the assignment."""

from __future__ import annotations

from shoal.engine.lora.slots import BASE_SLOT, LoRASlots

A, B, C, D = (("a", "/a"), ("b", "/b"), ("c", "/c"), ("d", "/d"))


def test_slots_fill_then_the_least_recently_used_adapter_leaves() -> None:
    slots = LoRASlots(2)
    assert slots.assign([A, None, B, A]) == ([0, BASE_SLOT, 1, 0], [(0, A), (1, B)])
    assert slots.assign([B]) == ([1], [])  # live: nothing to load; A is now the older
    assert slots.assign([C]) == ([0], [(0, C)])  # A leaves
    assert slots.live() == [B, C] and slots.num_loads == 3


def test_an_adapter_of_this_step_is_never_evicted_for_another_of_it() -> None:
    slots = LoRASlots(2)
    slots.assign([A])
    slots.assign([B])
    assert slots.assign([A, C]) == ([0, 1], [(1, C)])  # B, not A, makes room


def test_the_order_of_a_steps_requests_does_not_change_the_slots() -> None:
    one, two = LoRASlots(2), LoRASlots(2)
    for step in ([A, B], [C, A], [D, B], [A, C]):
        assert one.assign(step)[0] == two.assign(list(reversed(step)))[0][::-1]
    assert one.live() == two.live()


def test_the_cpu_set_keeps_the_most_recently_used_and_every_live_adapter() -> None:
    slots = LoRASlots(1, num_cpu=2)
    for key in (A, B, A, C, A):
        slots.assign([key])
        assert set(slots.live()) <= set(slots.cached())
    assert slots.cached() == [C, A] and slots.num_loads == 5
