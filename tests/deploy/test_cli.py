"""The `shoal` CLI: flag parsing, and serve --detached / status / stop on a real local Ray."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from shoal.cluster.placement import live_placement_group_names
from shoal.deploy import cli, serve
from shoal.deploy.status import format_status
from shoal.engine.config import EngineConfig, engine_kwargs_from_cli
from tests.factories import make_tiny_checkpoint, smollm2_path
from tests.ray_utils import (
    REPO_ROOT,
    TINY_ENGINE_FLAGS,
    free_port,
    ray_env,
    ray_local,
    unique_namespace,
)

__all__ = ["ray_local"]


@pytest.fixture
def restore_signals() -> Iterator[None]:
    """`shoal serve` installs SIGTERM/SIGINT handlers; give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_serve_flags_map_onto_the_engine_config() -> None:
    argv = [
        "--model", "/models/tiny", "--data-parallel-size", "2", "--dtype", "float32",
        "--max-model-len", "128", "--no-enable-prefix-caching", "--namespace", "prod",
        "--num-gpus-per-rank", "2", "--placement-strategy", "spread",
    ]  # fmt: skip
    args = cli.build_parser().parse_args(["serve", *argv])
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs_from_cli(args))
    assert config.model.model == "/models/tiny"
    assert config.model.dtype == "float32" and config.model.max_model_len == 128
    assert config.parallel.data_parallel_size == 2
    assert not config.cache.enable_prefix_caching
    assert (args.namespace, args.address, args.num_gpus_per_rank) == ("prod", "auto", 2.0)
    assert args.placement_strategy == "spread" and not args.detached

    # `python -m shoal.deploy.serve ARGS` parses exactly like `shoal serve ARGS`.
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    assert vars(parser.parse_args(argv)) == {k: v for k, v in vars(args).items() if k != "command"}
    no_model = cli.build_parser().parse_args(["serve", "--data-parallel-size", "2"])
    with pytest.raises(ValueError, match="no model given"):
        serve.model_of(no_model)


@pytest.mark.slow
def test_demo_streams_real_answers_from_both_ranks() -> None:
    """The README's first command: two ranks of SmolLM2, answers printed with their rank."""
    smollm2_path()  # skips when the model wheel is missing
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.deploy",
            "demo",
            "--max-tokens",
            "12",
            "--namespace",
            "demo-test",
        ],
        capture_output=True,
        text=True,
        env=ray_env(),
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("[rank ") == 6, out
    assert "[rank 0]" in out and "[rank 1]" in out
    assert "Paris" in out  # the capital of France, greedy, from the real model
    assert "cluster stopped" in out


def test_commands_on_a_cluster_without_ray_fail_fast_and_clearly() -> None:
    for command, *flags in (
        ("status",),
        ("stop",),
        ("scale", "--data-parallel-size", "1"),
        ("drain", "--rank", "1"),
    ):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "shoal.deploy",
                command,
                *flags,
                "--address",
                f"127.0.0.1:{free_port()}",
            ],
            capture_output=True,
            text=True,
            env=ray_env(),
            cwd=REPO_ROOT,
            timeout=60,
        )
        assert result.returncode == 1
        assert f"shoal {command}: no Ray cluster at" in result.stderr


def test_format_status_shows_ranks_load_and_clients() -> None:
    status = {
        "namespace": "prod", "model": "/m", "epoch": 4, "served_by": "host:1",
        "detached": False, "stopping": False,
        "ranks": [
            {"rank": 0, "state": "ready", "engine": "vllm", "incarnation": 2,
             "address": "tcp://h:1", "load": {"num_running_reqs": 3, "num_waiting_reqs": 1, "kv_cache_usage": 0.25,
                      "step_counter": 40, "num_cached_blocks": 12,
                      "prefix_cache_queries_total": 800, "prefix_cache_hits_total": 600}},
            {"rank": 1, "state": "dead", "incarnation": 1, "address": None, "load": None},
            {"rank": 2, "state": "starting", "incarnation": 0, "address": None, "load": None,
             "pending": "loading weights 40% (108 of 272 tensors, 3.1 s)"},
        ],
        "clients": [{"client_index": 0, "name": "api-server", "attached_at": 0.0}],
    }  # fmt: skip
    lines = format_status(status).splitlines()
    assert lines[0] == "namespace prod  model /m  membership epoch 4"
    assert lines[1].startswith("served by `shoal serve`, process 1 on host (")
    assert lines[3].split()[:4] == ["RANK", "STATE", "ENGINE", "RESTARTS"]
    # Restarts count the incarnations after the first.
    assert lines[4].split() == [
        "0", "ready", "vllm", "1", "3", "1", "25.0%", "40", "12", "75.0%", "tcp://h:1"
    ]  # fmt: skip
    assert lines[5].split() == ["1", "dead", "-", "0", "-", "-", "-", "-", "-", "-", "-"]
    # A rank still starting is pending, with what it waits for in the last column.
    assert lines[6].split()[:4] == ["2", "pending", "-", "-"]
    assert lines[6].endswith("  loading weights 40% (108 of 272 tensors, 3.1 s)")
    legend = " ".join(lines[8:14])
    for column in (
        "ENGINE:",
        "RESTARTS:",
        "RUNNING, QUEUED:",
        "KV USED:",
        "STEPS:",
        "CACHED:",
        "HIT RATE:",
    ):
        assert column in legend, legend
    assert "clients: 1" in lines and "api-server" in lines[-1]
    assert "rank failures in the last 10 min: 0" in lines


def test_format_status_says_who_keeps_the_cluster() -> None:
    base = {
        "namespace": "prod", "model": "/m", "epoch": 1, "served_by": None, "detached": True,
        "stopping": False, "ranks": [], "clients": [],
    }  # fmt: skip
    assert format_status(base).splitlines()[1] == (
        "detached: no process serves it; `shoal stop` tears it down"
    )
    served = {**base, "detached": False, "served_by": "vm:2174", "stopping": True}
    assert format_status(served).splitlines()[1] == (
        "served by `shoal serve`, process 2174 on vm (it stops the cluster on `shoal stop`)"
        "  STOPPING"
    )


def test_format_status_counts_the_recent_rank_failures() -> None:
    now = time.time()
    status = {
        "namespace": "prod", "model": "/m", "epoch": 9, "served_by": None,
        "detached": False, "stopping": False, "ranks": [], "clients": [],
        "rank_failures": [{"at": now - 3600, "rank": 0}, {"at": now - 120, "rank": 1},
                          {"at": now - 30, "rank": 2}],
    }  # fmt: skip
    lines = format_status(status).splitlines()
    assert "rank failures in the last 10 min: 2 (latest: rank 2, 30 s ago)" in lines


def test_format_status_lists_each_tp_ranks_group_and_workers() -> None:
    worker = {
        "tp_rank": 1,
        "pid": 4242,
        "device": "cuda:0 (GPU 5)",
        "node_ip": "10.0.0.7",
        "node_id": "0123456789abcdef0123",
    }
    status = {
        "namespace": "prod", "model": "/m", "epoch": 2, "served_by": None,
        "detached": False, "stopping": False, "tensor_parallel_size": 2, "clients": [],
        "ranks": [
            {"rank": 0, "state": "ready", "incarnation": 1, "address": "tcp://h:1",
             "load": None, "placement_group": "shoal-prod-rank-0",
             "workers": [{**worker, "tp_rank": 0, "pid": 4241}, worker]},
            {"rank": 1, "state": "dead", "incarnation": 1, "address": None, "load": None,
             "placement_group": "shoal-prod-rank-1", "workers": []},
        ],
    }  # fmt: skip
    lines = format_status(status).splitlines()
    assert lines[0].endswith("TP 2 (4 workers)")
    assert lines[4].split()[:2] == ["0", "ready"]
    assert lines[5:8] == [
        "     placement group shoal-prod-rank-0",
        "     TP 0  pid 4241    cuda:0 (GPU 5)    node 10.0.0.7 (0123456789ab)",
        "     TP 1  pid 4242    cuda:0 (GPU 5)    node 10.0.0.7 (0123456789ab)",
    ]
    assert lines[8].split()[:2] == ["1", "dead"]
    assert lines[9:11] == ["     placement group shoal-prod-rank-1", ""]  # no worker of it


@pytest.mark.slow
def test_detached_serve_then_status_then_stop(
    ray_local: str,
    tmp_path_factory: pytest.TempPathFactory,
    restore_signals: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")
    namespace = unique_namespace("cli")
    serve_argv = [
        "serve", "--model", checkpoint, "--data-parallel-size", "2", "--namespace", namespace,
        "--data-parallel-address", "127.0.0.1", "--detached", *TINY_ENGINE_FLAGS,
    ]  # fmt: skip
    assert cli.main(serve_argv) == 0
    capsys.readouterr()

    assert cli.main(["status", "--namespace", namespace, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["state"]) for r in status["ranks"]] == [(0, "ready"), (1, "ready")]
    assert status["detached"] and status["served_by"] is None and status["clients"] == []

    registry = ray.get_actor("shoal-registry", namespace=namespace)
    ray.get(registry.attach_client.remote("notebook", None))
    assert cli.main(["status", "--namespace", namespace]) == 0
    text = capsys.readouterr().out
    assert "clients: 1" in text and "notebook" in text and "tcp://127.0.0.1:" in text

    # A second serve into the same namespace is refused, and leaves the first alone.
    assert cli.main(serve_argv) == 1

    # Nobody serves a detached cluster: stop tears it down itself.
    assert cli.main(["stop", "--namespace", namespace]) == 0
    assert f"stopped the shoal cluster in namespace {namespace}" in capsys.readouterr().out
    names = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace
    ]
    assert names == []
    assert live_placement_group_names(namespace) == []

    assert cli.main(["stop", "--namespace", namespace]) == 1
    assert "no shoal cluster runs in namespace" in capsys.readouterr().err


def test_a_model_path_no_node_has_fails_before_any_actor_starts(
    ray_local: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, restore_signals: None
) -> None:
    """On a one-node cluster a path missing here is missing everywhere: one line, exit 2."""
    namespace = unique_namespace("cli")
    missing = str(tmp_path / "no-such-model")
    assert cli.main(["serve", missing, "--namespace", namespace]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and f"model path {missing} does not exist" in errors[0], errors
    names = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace
    ]
    assert names == []
