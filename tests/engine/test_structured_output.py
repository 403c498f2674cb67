"""Structured outputs in the engine: grammars compiled per request, masks applied in the step.

A tiny random model follows whatever the mask allows, so each test checks the grammar's
enforcement (the output fits the constraint, greedy or sampled), not the model's skill.
"""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import numpy as np
import pytest
import torch

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.model.sampler import Sampler
from shoal.engine.protocol import (
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    StructuredOutputsParams,
)
from shoal.engine.request import Request
from shoal.engine.tokenizer import Tokenizer, load_tokenizer
from tests.factories import make_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "unit", "days", "hourly"],
    "additionalProperties": False,
}

_FREE = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def core(checkpoint: str) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(checkpoint, max_model_len=256))


@pytest.fixture(scope="module")
def tokenizer(checkpoint: str) -> Tokenizer:
    return load_tokenizer(checkpoint)


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, tuple[list[int], ...]]:
    """request id → (token ids, [finish reason], [error message])."""
    for request in requests:
        core.add_request(request)
    results: dict[str, tuple[list[int], ...]] = {}
    while core.has_unfinished_requests():
        for outputs in core.step().values():
            for output in outputs.outputs:
                ids, reason, error = results.setdefault(output.request_id, ([], [], []))
                ids.extend(output.new_token_ids)
                if output.finished:
                    reason.append(output.finish_reason)
                    error.append(output.error_message)
    return results


def _request(
    request_id: str, constraint: StructuredOutputsParams, temperature: float, **kw: object
) -> EngineCoreRequest:
    params = SamplingParams(
        max_tokens=120, temperature=temperature, seed=7, structured_outputs=constraint
    )
    return EngineCoreRequest(request_id, [5, 6, 7, 8], params, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constraint_kind_holds_greedy_and_sampled(
    core: EngineCore, tokenizer: Tokenizer, temperature: float
) -> None:
    constraints = {
        "json": StructuredOutputsParams(json=SCHEMA),
        "json-text": StructuredOutputsParams(json=json.dumps(SCHEMA)),
        "object": StructuredOutputsParams(json_object=True),
        "regex": StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{3}"),
        "choice": StructuredOutputsParams(choice=["red", "green", "blue"]),
        "grammar": StructuredOutputsParams(grammar='start: "x=" NUM\nNUM: /[0-9]{1,4}/'),
        "free": None,  # unconstrained, in the same batch
    }
    # Any JSON object: a random model may write one key until max_tokens, so only its start
    # (and, when it ends, the whole) is checked.
    bounded = set(constraints) - {"free", "object"}
    requests = [
        _request(name, c, temperature) if c else EngineCoreRequest(name, [5], _FREE)
        for name, c in constraints.items()
    ]
    results = _run(core, requests)
    texts = {name: tokenizer.decode(ids) for name, (ids, _, _) in results.items()}
    for name in bounded:
        assert results[name][1] == [FinishReason.STOP], (name, texts[name])
    jsonschema.validate(json.loads(texts["json"]), SCHEMA)
    jsonschema.validate(json.loads(texts["json-text"]), SCHEMA)
    assert texts["object"].startswith("{")
    if results["object"][1] == [FinishReason.STOP]:
        assert isinstance(json.loads(texts["object"]), dict)
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", texts["regex"])
    assert texts["choice"] in {"red", "green", "blue"}
    assert re.fullmatch(r"x=[0-9]{1,4}", texts["grammar"])
    assert len(results["free"][0]) == 16


def test_a_constraint_that_does_not_compile_fails_only_its_request(core: EngineCore) -> None:
    bad = {
        "bad-type": StructuredOutputsParams(json={"type": "nonsense"}),
        "bad-json": StructuredOutputsParams(json="{not json"),
        "bad-regex": StructuredOutputsParams(regex="(("),
        "bad-grammar": StructuredOutputsParams(grammar="start: undefined_rule"),
    }
    good = _request("good", StructuredOutputsParams(choice=["yes", "no"]), 0.0)
    results = _run(core, [_request(name, c, 0.0) for name, c in bad.items()] + [good])
    for name in bad:
        ids, reason, error = results[name]
        assert reason == [FinishReason.ERROR] and not ids
        assert error[0] and ("structured_outputs" in error[0] or "JSON schema" in error[0]), error
    assert "nonsense" in str(results["bad-type"][2][0])
    assert results["good"][1] == [FinishReason.STOP]


def test_a_resumed_request_continues_its_grammar(core: EngineCore, tokenizer: Tokenizer) -> None:
    prefix = tokenizer.encode('{"city":"Pa', add_special_tokens=False)
    constraint = StructuredOutputsParams(json=SCHEMA)
    resumed = _request("resumed", constraint, 0.0, resumed_output_token_ids=prefix)
    off = tokenizer.encode("[1,", add_special_tokens=False)
    broken = _request("broken", constraint, 0.0, resumed_output_token_ids=off)
    results = _run(core, [resumed, broken])
    text = tokenizer.decode(prefix + results["resumed"][0])
    assert json.loads(text)["city"].startswith("Pa")
    assert results["broken"][1] == [FinishReason.ERROR]
    assert "does not fit the grammar" in str(results["broken"][2][0])


def test_constraint_crosses_the_wire_as_data_and_is_validated() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    frame = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(frame, type=SamplingParams) == params
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    # A peer's frame with two kinds is refused when decoded, before any engine sees it.
    two = msgspec.msgpack.encode([None, "a", ["a"]])  # regex and choice, array_like
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        msgspec.msgpack.decode(two, type=StructuredOutputsParams)


def test_sampler_masks_only_constrained_rows(core: EngineCore) -> None:
    compiler = core.grammars.get()
    constrained = Request("c", [1, 2], SamplingParams(temperature=0.0))
    constrained.attach_grammar(compiler.compile(StructuredOutputsParams(choice=["7"])))
    free = Request("f", [1, 2], SamplingParams(temperature=0.0))
    vocab = core.arch.vocab_size
    logits = torch.zeros(2, vocab)
    logits[:, 3] = 10.0  # the likeliest token of both rows, unless masked
    bitmask = compiler.fill_bitmasks([constrained.grammar])  # type: ignore[list-item]
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].nonzero()[0]
    only = Sampler()(logits[:1].clone(), [constrained])  # every row constrained
    out = Sampler()(logits, [constrained, free])
    assert out.token_ids[1] == 3
    assert out.token_ids[0] in allowed.tolist() and out.token_ids[0] != 3
    assert only.token_ids == out.token_ids[:1]
