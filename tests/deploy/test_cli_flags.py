"""vLLM's flags on `shoal serve` / `shoal api-server`, their help, and the launch's fail-fast
checks (`shoal.deploy.flags`, `shoal.deploy.preflight`): every case here ends before Ray."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from shoal.deploy import cli, serve
from shoal.deploy.flags import HelpFormatter
from shoal.deploy.openai.chat import load_chat_template
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.server import front_end_config
from shoal.deploy.openai.state import ServerState
from shoal.engine.config import EngineConfig, engine_kwargs_from_cli
from tests.factories import make_tiny_checkpoint, make_tiny_gguf
from tests.ray_utils import REPO_ROOT, free_port, ray_env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def dead_ray_address() -> str:
    """An address nothing listens at: a command that reached for Ray would fail with 1."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_vllm_launch_line_parses_onto_the_config() -> None:
    args = cli.build_parser().parse_args(
        ["serve", "/models/llama", "-tp", "1", "--pipeline-parallel-size", "1",
         "--enforce-eager", "--trust-remote-code", "--disable-log-requests",
         "--generation-config", "vllm", "--uvicorn-log-level", "info", "--max-logprobs", "5",
         "--served-model-name", "llama", "meta-llama/Llama-3.2-1B", "--port", "8000",
         "--chat-template", "{{ messages[0]['content'] }}", "--seed", "0"]
    )  # fmt: skip
    assert serve.model_of(args) == "/models/llama"
    config = EngineConfig.from_kwargs(serve.model_of(args), **engine_kwargs_from_cli(args))
    assert config.model.max_logprobs == 5 and config.model.seed == 0
    front_end = front_end_config(args, args.port)
    assert front_end.served_model_names == ("llama", "meta-llama/Llama-3.2-1B")
    assert front_end.uvicorn_log_level == "info"
    assert front_end.chat_template == "{{ messages[0]['content'] }}"


def test_the_model_is_positional_or_a_flag_but_not_two_different_ones() -> None:
    def parse(*argv: str) -> argparse.Namespace:
        return cli.build_parser().parse_args(["serve", *argv])

    assert serve.model_of(parse("--model", "/m")) == "/m"
    assert serve.model_of(parse("/m", "--model", "/m")) == "/m"
    with pytest.raises(ValueError, match="two models given"):
        serve.model_of(parse("/a", "--model", "/b"))
    with pytest.raises(ValueError, match="no model given"):
        serve.model_of(parse())


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--pipeline-parallel-size", "4"], ["pipeline parallelism", "--data-parallel-size"]),
        (["--quantization", "awq"], ["--quantization", ".gguf"]),
        (["--speculative-config", "{}"], ["speculative decoding"]),
    ],
)
def test_a_flag_for_a_missing_feature_is_refused_in_one_line(
    argv: list[str], names: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["serve", "/m", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert all(name in err for name in names), err


@pytest.mark.parametrize("command", ["serve", "api-server"])
def test_every_flag_has_help_and_shows_its_default(command: str) -> None:
    subparsers = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    parser = subparsers.choices[command]
    assert parser.formatter_class is HelpFormatter
    formatter = HelpFormatter(command)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"{name} has no help"
        if action.default is not argparse.SUPPRESS:
            assert "default" in (formatter._get_help_string(action) or ""), name
    text = " ".join(parser.format_help().split())  # unwrapped
    assert "the HTTP server's log level (default: warning)" in text


def test_a_served_name_list_answers_to_every_name() -> None:
    state = ServerState(
        current_llm=None,
        model_name="llama",
        api_key=None,
        served_model_names=("llama", "meta-llama/Llama-3.2-1B"),
    )
    state.check_model("llama")
    state.check_model("meta-llama/Llama-3.2-1B")
    with pytest.raises(OpenAIError, match="does not exist"):
        state.check_model("gpt-4")


def test_a_chat_template_is_a_file_or_inline_jinja(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-size", "0"], "data_parallel_size must be at least 1"),
        (["--max-num-seqs", "-1"], "--max-num-seqs must not be negative"),
        (["--num-cpus-per-rank", "-2"], "--num-cpus-per-rank must not be negative"),
        (["--max-logprobs", "-1"], "--max-logprobs must not be negative"),
        (["--port", "8000", "--generation-config", "/nowhere"], "cannot read"),
        (["--port", "8000", "--chat-template", "{% if %}"], "does not parse"),
        (["-tp", "3"], "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
        (["-tp", "2", "--num-gpus-per-rank", "1"], "--num-gpus-per-rank 1 conflicts with"),
    ],
)
def test_bad_sizes_and_front_end_files_fail_in_one_line_before_ray(
    argv: list[str],
    message: str,
    checkpoint: str,
    dead_ray_address: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert cli.main(["serve", checkpoint, "--address", dead_ray_address, *argv]) == 2
    assert [m for m in _errors(caplog) if message in m], _errors(caplog)
    assert not ray.is_initialized()


def test_an_unservable_checkpoint_fails_before_ray(
    checkpoint: str,
    tmp_path: Path,
    dead_ray_address: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gguf = make_tiny_gguf(tmp_path / "tiny-gpt2.gguf", checkpoint, architecture="gpt2")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    for model, expected in [(gguf, "gpt2"), (str(gpt2), "GPT2LMHeadModel")]:
        caplog.clear()
        assert cli.main(["serve", model, "--address", dead_ray_address]) == 2
        errors = _errors(caplog)
        assert len(errors) == 1 and "cannot serve" in errors[0] and expected in errors[0], errors
    assert not ray.is_initialized()


def test_a_port_in_use_fails_before_ray(
    checkpoint: str, listening_port: int, dead_ray_address: str, caplog: pytest.LogCaptureFixture
) -> None:
    for command in (["serve", checkpoint], ["api-server"]):
        caplog.clear()
        argv = [*command, "--address", dead_ray_address, "--host", "127.0.0.1"]
        assert cli.main([*argv, "--port", str(listening_port)]) == 2
        errors = _errors(caplog)
        assert len(errors) == 1 and f"127.0.0.1:{listening_port}" in errors[0], errors
    assert not ray.is_initialized()


def test_generate_and_status_fail_at_once_on_an_unreachable_ray(
    dead_ray_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert cli.main(["generate", "--address", dead_ray_address, "hello"]) == 1
    assert cli.main(["status", "--address", dead_ray_address]) == 1
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0] for line in err] == ["shoal generate", "shoal status"], err
    assert all("no Ray cluster at" in line for line in err)


def test_the_console_command_refuses_in_one_line_without_a_traceback(checkpoint: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shoal.deploy", "serve", checkpoint, "--data-parallel-size", "0"],
        capture_output=True,
        text=True,
        env=ray_env(),
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
