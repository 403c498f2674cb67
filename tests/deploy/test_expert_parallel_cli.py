"""`shoal serve --enable-expert-parallel` refuses what it cannot serve before anything starts,
and `shoal status` shows the EP size, each rank's experts and the DP wave."""

from __future__ import annotations

import logging

import pytest
import ray

from shoal.deploy import cli
from shoal.deploy.status import format_status
from tests.factories import make_tiny_checkpoint


def _serve(model: str, ranks: int) -> list[str]:
    return [
        "serve",
        "--model",
        model,
        "--data-parallel-size",
        str(ranks),
        "--enable-expert-parallel",
    ]


def test_serve_refuses_expert_parallel_on_a_dense_model(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    dense = make_tiny_checkpoint(tmp_path, "llama")
    with caplog.at_level(logging.ERROR):
        assert cli.main(_serve(dense, 2)) == 2
    assert "needs a mixture-of-experts model; LlamaForCausalLM is dense" in caplog.text
    assert not ray.is_initialized(), "nothing may start for a refused launch"


def test_serve_refuses_more_ranks_than_experts(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    moe = make_tiny_checkpoint(tmp_path, "mixtral", num_experts=4, top_k=2)
    with caplog.at_level(logging.ERROR):
        assert cli.main(_serve(moe, 5)) == 2
    assert "over 5 ranks needs at least as many experts; the model has 4" in caplog.text
    assert not ray.is_initialized()


def test_status_shows_the_expert_placement_and_the_wave() -> None:
    status = {
        "namespace": "moe", "model": "/m", "epoch": 3, "served_by": None,
        "detached": True, "stopping": False, "ranks": [], "clients": [],
        "expert_parallel": {
            "size": 2, "num_experts": 8, "experts_per_rank": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "current_wave": 7, "running": False,
        },
    }  # fmt: skip
    lines = format_status(status).splitlines()
    assert "expert parallel: 2 ranks, 8 experts; wave 7 paused" in lines
    assert "  rank 1: experts 4, 5, 6, 7" in lines


def test_launch_refuses_it_before_starting_anything(tmp_path) -> None:
    from shoal.cluster.launch import launch
    from shoal.engine.config import EngineConfig

    dense = make_tiny_checkpoint(tmp_path, "llama")
    config = EngineConfig.from_kwargs(dense, data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        launch(config, namespace="never-started")
    assert not ray.is_initialized()
