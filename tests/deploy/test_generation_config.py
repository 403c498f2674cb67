"""`--generation-config` (`shoal.deploy.openai.generation_config`): the model's sampling
defaults, applied by `sampling_params` only where a request is silent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.deploy.openai.generation_config import load_generation_defaults
from shoal.deploy.openai.protocol import ChatCompletionRequest, CompletionRequest
from shoal.deploy.openai.sampling import sampling_params


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    document = {
        "temperature": 0.6, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1,
        "max_new_tokens": 77, "do_sample": True, "eos_token_id": [1, 2],
    }  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(document))
    return str(tmp_path)


def test_auto_reads_the_fields_vllm_reads_and_vllm_reads_none(model_dir: str) -> None:
    assert load_generation_defaults("auto", model_dir) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1,
        "max_tokens": 77,
    }  # fmt: skip
    assert load_generation_defaults(model_dir, "/elsewhere")["max_tokens"] == 77  # a folder
    assert load_generation_defaults("vllm", model_dir) == {}
    assert load_generation_defaults("auto", "/models/tiny.gguf") == {}


def test_a_missing_or_broken_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not on this node"):
        load_generation_defaults("auto", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="cannot read"):
        load_generation_defaults(str(tmp_path), "/m")
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="not a number"):
        load_generation_defaults(str(tmp_path), "/m")


def test_defaults_fill_only_what_a_request_leaves_unset(model_dir: str) -> None:
    defaults = load_generation_defaults("auto", model_dir)
    silent = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    params = sampling_params(silent, max_tokens=None, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 40)
    assert (params.repetition_penalty, params.max_tokens) == (1.1, 77)

    body = {"model": "m", "prompt": "hi", "temperature": 0.0, "top_p": None,
            "repetition_penalty": 1.0, "max_tokens": 5}  # fmt: skip
    given = CompletionRequest.model_validate(body)
    params = sampling_params(given, max_tokens=5, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.9, 40)  # null: default
    assert (params.repetition_penalty, params.max_tokens) == (1.0, 5)

    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert sampling_params(chat, max_tokens=None, defaults=defaults).max_tokens == 77
    assert sampling_params(chat, max_tokens=None).temperature == 1.0  # vllm: shoal's own
