"""`EngineThread`: a rank's engine is built on the thread that then runs its busy loop (one
OpenMP pool per rank), and a failed build reaches the actor's constructor."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest

from shoal.actors.engine_actor import EngineThread


class _Proc:
    """Records the thread of each call, as an `EngineCoreProc` would run on it."""

    def __init__(self) -> None:
        self.built_on = threading.get_ident()
        self.stepped_on: int | None = None
        self.stepped = threading.Event()

    def run_busy_loop(self) -> None:
        self.stepped_on = threading.get_ident()
        self.stepped.set()


def test_the_engine_is_built_and_stepped_on_one_thread_other_than_the_caller() -> None:
    thread = EngineThread(lambda: cast(Any, _Proc()), rank=3)
    proc = cast(_Proc, thread.wait_built())
    assert not proc.stepped.is_set()  # the loop waits for `serve`
    thread.serve()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert proc.stepped_on == proc.built_on == thread.ident
    assert proc.built_on != threading.get_ident()
    assert thread.name == "shoal-busy-loop-3"


def test_a_failed_build_raises_its_error_to_the_caller_and_ends_the_thread() -> None:
    def build() -> Any:
        raise ValueError("no such model")

    thread = EngineThread(build, rank=0)
    with pytest.raises(ValueError, match="no such model"):
        thread.wait_built()
    thread.join(timeout=10)
    assert not thread.is_alive()
