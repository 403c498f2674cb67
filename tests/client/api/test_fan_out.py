"""`n > 1` from the Python API: `LLM.generate` returns n sequences per prompt, each the one a
single request with seed `seed + i` gives."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams
from tests.factories import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")
    return LLM(checkpoint, num_gpu_blocks_override=64, max_model_len=256)


def test_n_sequences_per_prompt_each_seeded_like_a_single_request(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    outputs = llm.generate(["one prompt", "another"], params, use_tqdm=False)
    assert len(outputs) == 2
    for prompt, output in zip(["one prompt", "another"], outputs, strict=True):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert output.finished and output.prompt == prompt
        for i, completion in enumerate(output.outputs):
            single = SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True)
            alone = llm.generate(prompt, single, use_tqdm=False)[0].outputs[0]
            assert completion.token_ids == alone.token_ids and completion.text == alone.text


def test_n_must_be_positive() -> None:
    with pytest.raises(ValueError, match="n must be at least 1"):
        SamplingParams(n=0)
