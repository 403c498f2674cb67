"""StepWatchdog: a step that outlives its limit ends the engine process, clients told first."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from shoal.engine.core.core_proc import STEP_TIMEOUT_EXIT_CODE
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.core.step_watchdog import StepWatchdog
from shoal.engine.protocol import ENGINE_CORE_DEAD, EngineCoreRequestType
from tests.engine.core_proc_utils import RawPeer, request, tiny_config
from tests.factories import make_tiny_checkpoint


def test_only_a_step_that_outlives_the_limit_is_reported_and_only_once() -> None:
    reports: list[float] = []
    reported = threading.Event()

    def on_expired(running_s: float) -> None:
        reports.append(running_s)
        reported.set()

    watchdog = StepWatchdog(1.0, on_expired)  # wide margins: CI machines stall
    watchdog.start()
    try:
        for _ in range(3):  # steps well within the limit
            watchdog.step_started()
            time.sleep(0.02)
            watchdog.step_finished()
        time.sleep(0.5)  # idle between steps is not a step
        assert reports == []
        watchdog.step_started()
        assert reported.wait(10)
        watchdog.join(timeout=10)  # it reports once, then stops watching
        assert not watchdog.is_alive()
        assert len(reports) == 1 and reports[0] > 1.0
    finally:
        watchdog.stop()


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        StepWatchdog(0, lambda _s: None)


@pytest.mark.slow
def test_an_engine_whose_step_outlives_the_limit_tells_its_clients_and_exits(
    tmp_path: Path,
) -> None:
    # A real step longer than the limit: a 4000-token prefill in one step takes well over
    # 20 ms on the tiny model. What a hung kernel would do, only slower to say so.
    path = make_tiny_checkpoint(tmp_path, "llama", max_position_embeddings=4096)
    config = tiny_config(
        path,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        num_gpu_blocks_override=512,
        step_timeout_s=0.02,
    )
    process, endpoint = start_engine_process(config, engine_index=2)
    peer = RawPeer(endpoint)
    try:
        peer.hello()
        prompt = [1 + i % 97 for i in range(4000)]
        peer.send_typed(EngineCoreRequestType.ADD, request("long", prompt, max_tokens=2))
        assert peer.recv_frames(timeout_s=10) == [ENGINE_CORE_DEAD, b"2"]
        process.join(timeout=10)
        assert process.exitcode == STEP_TIMEOUT_EXIT_CODE
    finally:
        peer.close()
        stop_engine_process(process)
