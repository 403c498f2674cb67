"""`TokenizerPool`'s bounds on memory: inputs past `LARGE_INPUT` run one at a time, and the
threads return freed memory to the system after large calls. (The resident size of a real
front end before and after a burst of large `/tokenize` calls:
tests/security/test_poison_requests.py and `bench/attack.py`.)"""

from __future__ import annotations

import asyncio
import threading

import pytest

from shoal.deploy.openai import tokenizer_pool
from shoal.deploy.openai.tokenizer_pool import LARGE_INPUT, SMALL_INPUT, TRIM_INPUT, TokenizerPool
from shoal.engine.tokenizer import load_tokenizer
from tests.factories import make_tiny_checkpoint


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> TokenizerPool:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    return TokenizerPool(load_tokenizer(checkpoint), num_workers=3)


class _Overlap:
    """A call that waits until `num_expected` of its kind run at once, or `timeout_s`."""

    def __init__(self, num_expected: int, timeout_s: float) -> None:
        self.barrier = threading.Barrier(num_expected, timeout=timeout_s)
        self.max_running = 0
        self._running = 0
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            self._running += 1
            self.max_running = max(self.max_running, self._running)
        try:
            self.barrier.wait()
            return True
        except threading.BrokenBarrierError:
            return False
        finally:
            with self._lock:
                self._running -= 1


async def test_large_inputs_run_one_at_a_time_and_smaller_ones_together(
    pool: TokenizerPool,
) -> None:
    together = _Overlap(3, timeout_s=60.0)
    assert (
        await asyncio.gather(*(pool.run(together, size=SMALL_INPUT) for _ in range(3)))
        == [True] * 3
    )
    alone = _Overlap(2, timeout_s=1.0)  # large calls never meet: each waits out the timeout
    results = await asyncio.gather(*(pool.run(alone, size=LARGE_INPUT) for _ in range(2)))
    assert results == [False, False] and alone.max_running == 1


async def test_freed_memory_is_returned_after_large_calls_only(
    pool: TokenizerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    released: list[str] = []
    monkeypatch.setattr(
        tokenizer_pool,
        "release_free_memory",
        lambda: released.append(threading.current_thread().name),
    )
    text = "a b " * (TRIM_INPUT // 4)
    ids = await pool.run(pool.tokenizer.encode, text, size=len(text))
    assert ids and len(released) == 1 and released[0].startswith("shoal-tokenizer")
    await pool.run(pool.tokenizer.encode, text[: SMALL_INPUT * 2], size=SMALL_INPUT * 2)
    assert len(released) == 1


def test_the_allocator_hands_memory_back_here() -> None:
    """glibc's `malloc_trim` is found (this is the Linux the front ends run on)."""
    assert tokenizer_pool._malloc_trim() is not None
    tokenizer_pool.release_free_memory()
