"""A pooling engine (`--runner pooling`): each prompt's final hidden states (after the last
norm), pooled LAST or MEAN and normalised, equal transformers' `LlamaModel` outputs pooled the
same way, within the reordering tolerance of tests/tolerances.py; chunked prefill, batching
and the prefix cache change nothing; an engine refuses the other kind of request."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import torch
import transformers

from shoal.client.api.llm import LLM
from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    LoRARequest,
    PoolingParams,
    SamplingParams,
)
from shoal.engine.tokenizer import load_tokenizer
from tests.factories import make_tiny_checkpoint
from tests.tolerances import assert_reordered_close, decoder_reduction_length

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then some more words follow it.",
    "Embeddings",
    "A third prompt, of middling length, for the batch.",
]
_ENGINE: dict[str, Any] = {"num_gpu_blocks_override": 64, "max_model_len": 256}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pool"))


def _hf_states(checkpoint: str, token_ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the model's last norm) of one prompt."""
    model = transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]))
    return out.last_hidden_state[0]


def _length(num_tokens: int) -> int:
    """The reductions behind a pooled vector: the decoder's, and MEAN's sum over the prompt."""
    config = {"hidden": 64, "intermediate": 128, "head_dim": 16, "num_layers": 2}
    return decoder_reduction_length(**config, context=num_tokens) + num_tokens


def _embed(checkpoint: str, pooler: dict[str, Any], **kwargs: Any) -> list[torch.Tensor]:
    llm = LLM(checkpoint, runner="pooling", pooler_config=pooler, **_ENGINE, **kwargs)
    try:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert all(o.error is None and o.finished for o in outputs)
    return [torch.tensor(o.outputs.embedding) for o in outputs]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_pooled_states_equal_transformers(checkpoint: str, pooling_type: str) -> None:
    tokenizer = load_tokenizer(checkpoint)
    raw = _embed(checkpoint, {"pooling_type": pooling_type, "use_activation": False})
    normalised = _embed(checkpoint, {"pooling_type": pooling_type})
    for prompt, ours, ours_normalised in zip(PROMPTS, raw, normalised, strict=True):
        token_ids = tokenizer.encode(prompt)
        states = _hf_states(checkpoint, token_ids)
        expected = states[-1] if pooling_type == "LAST" else states.mean(dim=0)
        assert ours.shape == (64,)
        assert_reordered_close(ours, expected, length=_length(len(token_ids)))
        assert math.isclose(float(ours_normalised.norm()), 1.0, rel_tol=1e-5)
        assert_reordered_close(
            ours_normalised,
            expected / expected.norm(),
            length=_length(len(token_ids)),
            scale=1.0,
        )


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_chunked_prefill_and_the_prefix_cache_change_nothing(
    checkpoint: str, pooling_type: str
) -> None:
    pooler = {"pooling_type": pooling_type}
    whole = _embed(checkpoint, pooler, max_num_batched_tokens=512)
    # Chunks of 8 tokens, and the first prompt again: its blocks are cached (LAST uses them).
    llm = LLM(
        checkpoint,
        runner="pooling",
        pooler_config=pooler,
        max_num_batched_tokens=8,
        **_ENGINE,
    )
    try:
        chunked = llm.embed(PROMPTS, use_tqdm=False)
        again = llm.embed(PROMPTS[0], use_tqdm=False)[0]
    finally:
        llm.shutdown()
    for a, b in zip(whole, chunked, strict=True):
        assert_reordered_close(torch.tensor(b.outputs.embedding), a, length=_length(32), scale=1.0)
    assert_reordered_close(
        torch.tensor(again.outputs.embedding), whole[0], length=_length(32), scale=1.0
    )


def test_each_engine_refuses_the_other_kind_of_request(checkpoint: str) -> None:
    pooling = LLM(checkpoint, runner="pooling", **_ENGINE)
    try:
        (output,) = pooling.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert output.error is not None and "answers embedding requests only" in output.error
        use_raw = PoolingParams(use_activation=False)
        (raw,) = pooling.embed("hi", use_raw, use_tqdm=False)
        assert not math.isclose(float(torch.tensor(raw.outputs.embedding).norm()), 1.0)
    finally:
        pooling.shutdown()
    generating = LLM(checkpoint, **_ENGINE)
    try:
        (refused,) = generating.embed("hi", use_tqdm=False)
        assert refused.error is not None and "--runner pooling" in refused.error
        assert refused.outputs.embedding == []
    finally:
        generating.shutdown()


def test_a_prompt_as_long_as_the_context_is_pooled(checkpoint: str) -> None:
    llm = LLM(checkpoint, runner="pooling", num_gpu_blocks_override=64, max_model_len=16)
    try:
        fits, too_long = llm.embed([list(range(1, 17)), list(range(1, 18))], use_tqdm=False)
    finally:
        llm.shutdown()
    assert fits.error is None and len(fits.outputs.embedding) == 64
    assert too_long.error is not None and "maximum context length is 16" in too_long.error


def test_an_embed_call_past_max_sequences_per_request_queues_nothing(checkpoint: str) -> None:
    llm = LLM(checkpoint, runner="pooling", max_sequences_per_request=1, **_ENGINE)
    try:
        with pytest.raises(ValueError, match="2 sequences"):
            llm.embed(["a", "b"], use_tqdm=False)
        (one,) = llm.embed(["a"], use_tqdm=False)
        assert one.error is None
    finally:
        llm.shutdown()


def test_the_wire_fields_are_appended_so_older_frames_still_decode() -> None:
    request = EngineCoreRequest(
        "r",
        [1],
        SamplingParams(),
        pooling_params=PoolingParams(False),
        lora_request=LoRARequest("a", 1, "/a"),
    )
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
    # pooling_params, then the newer priority, then the newest lora_request
    assert fields[-3:] == [[False], 0, ["a", 1, "/a"]]
    before_lora = msgspec.msgpack.encode(fields[:-1])
    assert msgspec.msgpack.decode(before_lora, type=EngineCoreRequest).lora_request is None
    before_priority = msgspec.msgpack.encode(fields[:-2])
    assert msgspec.msgpack.decode(before_priority, type=EngineCoreRequest).priority == 0
    before_pooling = msgspec.msgpack.encode(fields[:-3])
    assert msgspec.msgpack.decode(before_pooling, type=EngineCoreRequest).pooling_params is None
    output = EngineCoreOutput("r", pooled=[0.5, 0.25])
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(output))
    assert fields[-1] == [0.5, 0.25]
    older = msgspec.msgpack.encode(fields[:-1])
    assert msgspec.msgpack.decode(older, type=EngineCoreOutput).pooled is None
