"""`shoal serve` as a person sees it: each rank's start and its weights in percent before
"shoal cluster ready", and a `shoal stop` during the launch that ends the command with 0 and
one line, no traceback, nothing left running."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import ray

from shoal.deploy import cli
from tests.deploy.openai_utils import FrontEnd, spawn_shoal
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import TINY_ENGINE_FLAGS, RayHead, ray_head, unique_namespace

__all__ = ["ray_head"]

pytestmark = pytest.mark.slow

_WAIT_S = 240.0


def _wait_for_line(front_end: FrontEnd, pattern: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not re.search(pattern, front_end.log.read_text(errors="replace"), re.M):
        assert front_end.proc.poll() is None, front_end.output()
        assert time.monotonic() < deadline, f"no {pattern!r}:\n{front_end.output()}"
        time.sleep(0.3)


def test_serve_shows_each_ranks_weights_loading_then_stops_cleanly(
    ray_head: RayHead, tmp_path: Path
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    namespace = unique_namespace("serve-progress")
    args = ["serve", checkpoint, "--data-parallel-size", "2", "--namespace", namespace,
            "--data-parallel-address", "127.0.0.1", *TINY_ENGINE_FLAGS]  # fmt: skip
    front_end = spawn_shoal(ray_head, args, tmp_path / "serve.log")
    try:
        _wait_for_line(front_end, r"shoal cluster ready")
        log = front_end.log.read_text()
        for rank in (0, 1):
            loading = log.index(f"rank {rank}: loading weights 0% (0 of ")
            loaded = log.index(f"rank {rank}: loaded weights: ")
            assert loading < loaded < log.index(f"rank {rank} serves") < log.index("cluster ready")
        assert cli.main(["stop", "--namespace", namespace, "--address", ray_head.gcs_address]) == 0
        assert front_end.proc.wait(_WAIT_S) == 0, front_end.output()
    finally:
        front_end.stop()
        ray.shutdown()


def test_a_stop_during_the_launch_ends_serve_with_0_and_no_traceback(
    ray_head: RayHead, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rank asks for more CPUs than the head has: the launch waits for a node, `shoal
    status` shows the rank pending for that reason, and `shoal stop` ends the launch."""
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    namespace = unique_namespace("serve-stop")
    args = ["serve", checkpoint, "--data-parallel-size", "1", "--namespace", namespace,
            "--num-cpus-per-rank", "64", "--data-parallel-address", "127.0.0.1",
            *TINY_ENGINE_FLAGS]  # fmt: skip
    address = ["--namespace", namespace, "--address", ray_head.gcs_address]
    front_end = spawn_shoal(ray_head, args, tmp_path / "serve.log")
    try:
        _wait_for_line(front_end, r"has room for 0 of 1 ranks")
        deadline = time.monotonic() + _WAIT_S
        while True:
            assert cli.main(["status", *address]) == 0
            table = capsys.readouterr().out
            if "waiting for resources" in table:
                break
            assert time.monotonic() < deadline, table
            time.sleep(0.5)
        assert re.search(
            r"^0    pending .* waiting for resources: a node with 64 CPUs free$", table, re.M
        ), table
        assert cli.main(["stop", *address]) == 0
        assert front_end.proc.wait(_WAIT_S) == 0, front_end.output()
        log = front_end.log.read_text()
        assert "`shoal stop` asked the cluster to stop while its ranks started" in log
        assert "Traceback" not in log, log
    finally:
        front_end.stop()
        ray.shutdown()
