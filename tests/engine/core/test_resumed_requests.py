"""Resumed requests: a request handed over with the output another rank generated continues
exactly as the uninterrupted request would have, and emits only the tokens after that output."""

from __future__ import annotations

import msgspec
import pytest

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from tests.factories import make_tiny_checkpoint

PROMPT = [17, 42, 99, 5, 230, 61, 8]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    config = EngineConfig.from_kwargs(path, max_model_len=MAX_MODEL_LEN, block_size=4)
    return EngineCore(config)


def _run(core: EngineCore, *requests: EngineCoreRequest) -> dict[str, list[EngineCoreOutput]]:
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[EngineCoreOutput]] = {}
    while core.has_unfinished_requests():
        for frame in core.step().values():
            for output in frame.outputs:
                outputs.setdefault(output.request_id, []).append(output)
    return outputs


def _generate(
    core: EngineCore, request_id: str, params: SamplingParams, resumed: list[int] | None = None
) -> tuple[list[int], FinishReason | None]:
    request = EngineCoreRequest(request_id, PROMPT, params, resumed_output_token_ids=resumed or [])
    outputs = _run(core, request)[request_id]
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    return [t for o in outputs for t in o.new_token_ids], outputs[-1].finish_reason


def _assert_resumes_exactly(core: EngineCore, params: SamplingParams, ks: list[int]) -> list[int]:
    """Every resume point k continues with the uninterrupted run's tokens after k."""
    full, reason = _generate(core, "whole", params)
    for k in ks:
        assert k < len(full)
        core.reset_prefix_cache()  # alternately from scratch and over the cached prefix
        rest, rest_reason = _generate(core, f"resumed-{k}", params, full[:k])
        assert rest == full[k:], f"resumed after {k} tokens"
        assert rest_reason == reason
    return full


def test_a_greedy_request_resumes_with_the_remaining_tokens_only(core: EngineCore) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = _assert_resumes_exactly(core, params, [1, 5, 11])
    assert len(full) == 12


def test_a_stop_token_ends_a_resumed_request_where_it_ended_the_whole_one(
    core: EngineCore,
) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens, _ = _generate(core, "plain", plain)
    stop_id = tokens[6]
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]
    )
    full = _assert_resumes_exactly(core, params, [2, tokens.index(stop_id)])
    assert full[-1] == stop_id


def test_min_tokens_counts_the_resumed_output(core: EngineCore) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens, _ = _generate(core, "plain", plain)
    stop_id = tokens[2]
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=6
    )
    full = _assert_resumes_exactly(core, params, [1, 3, 5, 7])
    assert stop_id not in full[:6], "min_tokens masks the stop token in the whole run"


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8}],
    ids=lambda p: next(iter(p)),
)
def test_penalties_see_the_resumed_output_as_generated(
    core: EngineCore, penalty: dict[str, float]
) -> None:
    plain, _ = _generate(
        core, "plain", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalty)  # type: ignore[arg-type]
    full = _assert_resumes_exactly(core, params, [3, 5, 8])
    assert full != plain, "the penalty changes this model's greedy tokens"
    if "repetition_penalty" in penalty:
        return  # it covers the prompt as well: re-prompting would be indistinguishable
    # Re-prompting with the output as prompt is no resume: the penalty no longer sees it.
    reprompted = EngineCoreRequest("reprompted", PROMPT + full[:8], params)
    tokens = [t for o in _run(core, reprompted)["reprompted"] for t in o.new_token_ids]
    assert tokens[: len(full) - 8] != full[8:]


def test_a_seeded_random_request_resumes_with_the_same_draws(core: EngineCore) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    _assert_resumes_exactly(core, params, [4])


def test_pending_prefill_counts_the_resumed_output(core: EngineCore) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [t + 1 for t in PROMPT]  # no earlier test cached it: all of it is pending
    core.add_request(EngineCoreRequest("pending", prompt, params, resumed_output_token_ids=[1] * 5))
    assert core.make_stats().num_pending_prefill_tokens == len(prompt) + 5
    outputs = _run(core)["pending"]
    assert sum(len(o.new_token_ids) for o in outputs) == 3


def test_invalid_resumed_output_is_rejected_and_others_are_served(core: EngineCore) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    vocab = core.arch.vocab_size
    fits = MAX_MODEL_LEN - len(PROMPT) - 1
    no_limit = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    outputs = _run(
        core,
        EngineCoreRequest("at-max", PROMPT, params, resumed_output_token_ids=[3] * 4),
        EngineCoreRequest("oov", PROMPT, params, resumed_output_token_ids=[3, vocab]),
        EngineCoreRequest("negative", PROMPT, params, resumed_output_token_ids=[-1]),
        EngineCoreRequest("full", PROMPT, no_limit, resumed_output_token_ids=[3] * (fits + 1)),
        EngineCoreRequest("ok", PROMPT, params, resumed_output_token_ids=[3] * 3),
        EngineCoreRequest("last", PROMPT, no_limit, resumed_output_token_ids=[3] * fits),
    )
    errors = {
        rid: out[-1].error_message
        for rid, out in outputs.items()
        if out[-1].finish_reason == FinishReason.ERROR
    }
    assert "already reach max_tokens=4" in (errors["at-max"] or "")
    assert f"resumed output token ids must be in [0, {vocab})" in (errors["oov"] or "")
    assert "must be in" in (errors["negative"] or "")
    assert f"at most {MAX_MODEL_LEN - 1} leave room" in (errors["full"] or "")
    assert set(errors) == {"at-max", "oov", "negative", "full"}
    for rid in ("ok", "last"):  # one token each: max_tokens, then the context length
        assert [len(o.new_token_ids) for o in outputs[rid]] == [1]
        assert outputs[rid][-1].finish_reason == FinishReason.LENGTH


def test_the_field_is_appended_so_frames_without_it_still_decode() -> None:
    request = EngineCoreRequest("r", [1, 2], SamplingParams(), resumed_output_token_ids=[3, 4])
    encoded = msgspec.msgpack.encode(request)
    assert msgspec.msgpack.decode(encoded, type=EngineCoreRequest) == request
    fields = msgspec.msgpack.decode(encoded)
    position = EngineCoreRequest.__struct_fields__.index("resumed_output_token_ids")
    assert fields[position] == [3, 4]
    older = msgspec.msgpack.decode(
        msgspec.msgpack.encode(fields[:position]), type=EngineCoreRequest
    )
    assert older.resumed_output_token_ids == []
