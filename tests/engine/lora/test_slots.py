"""`LoRASlots`: the least used adapter leaves the slots (ties: the least recently used), use
decays, the least recently used leaves the CPU set, the live ones are always in the CPU set, and
a step's order of requests does not change the assignment."""

from __future__ import annotations

from shoal.engine.lora.slots import BASE_SLOT, HALF_LIFE_STEPS, LoRASlots

A, B, C, D = (("a", "/a"), ("b", "/b"), ("c", "/c"), ("d", "/d"))
ONE_OFFS = [(f"x{i}", f"/x{i}") for i in range(8)]


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


def test_a_popular_adapter_outlives_one_offs_that_came_after_it() -> None:
    """Least-recently-used alone would push A out for the second one-off: A ran in ten steps, B
    in one, so B leaves each time and A stays."""
    slots = LoRASlots(2)
    for _ in range(10):
        slots.assign([A])
    slots.assign([B])
    for one_off in ONE_OFFS:
        _, loads = slots.assign([one_off])
        assert loads == [(1, one_off)]  # B's slot, then each one-off's
    assert slots.live()[0] == A and slots.num_loads == 2 + len(ONE_OFFS)


def test_use_decays_so_a_shift_in_popularity_takes_over_the_slots() -> None:
    """A ran in as many steps as B, but earlier: its count has halved more, so A leaves for C
    although it ran last (least-recently-used would push B out, and so would undecayed use)."""
    slots = LoRASlots(2)
    for key in (A, B):
        for _ in range(2 * HALF_LIFE_STEPS):
            slots.assign([key])
    slots.assign([A])
    assert slots.assign([C]) == ([0], [(0, C)])  # A's slot
    assert set(slots.live()) == {B, C}


def test_a_live_adapter_stays_in_the_cpu_set_however_long_ago_it_was_cached() -> None:
    slots = LoRASlots(2, num_cpu=3)
    for _ in range(5):
        slots.assign([A])
    for key in (B, C, D):  # each evicts the last one-off, never A
        slots.assign([key])
    assert A in slots.live() and set(slots.live()) <= set(slots.cached())
    assert len(slots.cached()) == 3
