"""`LLM` end to end on real checkpoints: parity with HF, batching invariance, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.client import LLM, SamplingParams
from shoal.engine.errors import ModelLoadError
from tests.factories import hf_reference, make_tiny_checkpoint, smollm2_path
from tests.reference import assert_greedy_matches, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
    "Water boils at",
    "The three primary colors are red,",
    "In 1969, the first humans landed on the moon. The mission was called",
    "Translate to French: good morning ->",
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _varied_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.slow
def test_smollm2_greedy_is_token_identical_to_hf() -> None:
    path = smollm2_path()
    llm = LLM(path, dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    hf = hf_reference(path)
    tokenizer = llm.get_tokenizer()
    compared = 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.outputs[0].finish_reason == "length"
        reference = hf_greedy(hf, tokenizer.encode(prompt), 32)
        compared += assert_greedy_matches(out.outputs[0].token_ids, reference, label=prompt)
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
    assert compared >= 8 * 32 - 32, "too many comparisons cut short by ties"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_tiny_models_match_hf_greedy(tmp_path: Path, arch: str) -> None:
    path = make_tiny_checkpoint(tmp_path, arch)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    hf = hf_reference(path)
    prompts = _varied_prompts(hf.config.vocab_size, [3, 17, 40, 9, 64])
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        reference = hf_greedy(hf, prompt, GREEDY.max_tokens or 0)
        assert_greedy_matches(out.outputs[0].token_ids, reference, label=f"{arch} {len(prompt)}")


def test_same_tokens_alone_batched_cached_and_preempted(tiny_llama: str) -> None:
    target = _varied_prompts(512, [45], seed=1)[0]
    others = _varied_prompts(512, [30, 70, 12, 55, 90, 20], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    llm = LLM(tiny_llama, max_num_batched_tokens=64)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    batched = llm.generate([*others[:3], target, *others[3:]], params)[3]
    cached = llm.generate([target], params)[0]
    assert batched.outputs[0].token_ids == alone
    assert cached.num_cached_tokens > 0
    assert cached.outputs[0].token_ids == alone

    # 16 blocks of 16 tokens cannot hold all seven requests at once: some must be preempted.
    small = LLM(tiny_llama, num_gpu_blocks_override=16, enable_prefix_caching=False)
    preempted = small.generate([*others, target], params)
    assert small.get_stats().num_preemptions_total > 0
    assert preempted[-1].outputs[0].token_ids == alone
    reference = llm.generate(others, params)
    for got, want in zip(preempted[:-1], reference, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_repeated_long_prompt_reports_cached_tokens_and_computes_less(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, block_size=16)
    prompt = _varied_prompts(512, [300], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)

    before = llm.get_stats().num_prompt_tokens_total
    first = llm.generate([prompt], params)[0]
    mid = llm.get_stats().num_prompt_tokens_total
    second = llm.generate([prompt], params)[0]
    after = llm.get_stats().num_prompt_tokens_total

    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 288  # 18 full blocks; the last partial block is recomputed
    assert mid - before == 300
    assert after - mid == 300 - 288
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny_llama: str) -> None:
    llm = LLM(tiny_llama)
    prompt = _varied_prompts(512, [20], seed=4)[0]
    filler = _varied_prompts(512, [33, 7], seed=5)

    def sample(seed: int, batch: bool = False) -> list[int]:
        params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=20)
        prompts = [*filler, prompt] if batch else [prompt]
        return llm.generate(prompts, params)[-1].outputs[0].token_ids

    first = sample(123)
    assert sample(123) == first
    assert sample(123, batch=True) == first
    assert sample(124) != first


def test_stop_conditions(tiny_llama: str) -> None:
    llm = LLM(tiny_llama)
    prompt = _varied_prompts(512, [10], seed=6)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids

    by_token = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[5]])
    )[0].outputs[0]
    first_hit = tokens.index(tokens[5])
    assert by_token.token_ids == tokens[: first_hit + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == tokens[5]

    text = free[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        by_string = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
        )[0].outputs[0]
        assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
        assert by_string.text == text[: text.index(stop)]


def test_priority_orders_waiting_prompts_under_the_priority_policy(tiny_llama: str) -> None:
    """One sequence at a time, so the order of first tokens is the order of scheduling:
    lower priority first under "priority", the order given under "fcfs"."""
    prompts = _varied_prompts(512, [12, 12, 12], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def order(policy: str) -> list[int]:
        llm = LLM(tiny_llama, max_num_seqs=1, scheduling_policy=policy)
        outputs = llm.generate(prompts, params, priority=[2, 0, 1], use_tqdm=False)
        first = [out.metrics.first_token_time or 0.0 for out in outputs]
        return sorted(range(len(prompts)), key=first.__getitem__)

    assert order("priority") == [1, 2, 0]
    assert order("fcfs") == [0, 1, 2]
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        LLM(tiny_llama).generate(prompts, params, priority=[0, 1], use_tqdm=False)


def test_bad_requests_get_errors_and_leave_others_alone(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, max_model_len=128)
    good = _varied_prompts(512, [10, 20], seed=7)
    bad_params = SamplingParams(temperature=0.0, max_tokens=8)
    bad_params.top_p = 1.5  # mutated after construction: the engine must still catch it
    outputs = llm.generate(
        [good[0], list(range(200)), good[1], [5, 99999], good[0]],
        [GREEDY, GREEDY, GREEDY, GREEDY, bad_params],
    )
    assert [o.error is None for o in outputs] == [True, False, True, False, False]
    assert "maximum context length is 128" in (outputs[1].error or "")
    assert "[0, " in (outputs[3].error or "")
    assert "top_p" in (outputs[4].error or "")
    for out in (outputs[0], outputs[2]):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert all(o.outputs[0].finish_reason == "error" for o in outputs if o.error)


def test_a_call_past_max_sequences_per_request_queues_nothing(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, max_model_len=128, max_sequences_per_request=8)
    four = SamplingParams(n=4, max_tokens=2)
    with pytest.raises(ValueError, match="9 sequences"):
        llm.generate(["a", "b"], [four, SamplingParams(n=5, max_tokens=2)])
    assert [len(o.outputs) for o in llm.generate(["a", "b"], four)] == [4, 4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_sampling_params_raise(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_missing_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


def test_corrupt_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    weights = Path(path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        LLM(path)


def test_multiprocess_mode_matches_in_process(tiny_llama: str) -> None:
    prompts = _varied_prompts(512, [5, 40, 17], seed=8)
    inproc = LLM(tiny_llama).generate(prompts, GREEDY)
    mp = LLM(tiny_llama, multiprocess=True)
    try:
        outputs = mp.generate(prompts, GREEDY)
        assert mp.get_stats().num_running_reqs == 0
    finally:
        mp.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in inproc]


def test_chat_renders_the_template_and_adds_no_special_tokens(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, num_gpu_blocks_override=64)
    tokenizer = llm.get_tokenizer()
    conversations = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is two and two"},
        ],
    ]
    texts = [tokenizer.apply_chat_template(c) for c in conversations]
    assert texts[0] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY)
    both = llm.chat(conversations, GREEDY)
    assert [o.prompt_token_ids for o in both] == ids
    assert [o.prompt for o in both] == texts
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in by_ids]
    (one,) = llm.chat(conversations[0], GREEDY)  # a single conversation
    assert one.outputs[0].token_ids == both[0].outputs[0].token_ids


def test_use_tqdm_shows_a_progress_bar_or_nothing(
    tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    llm = LLM(tiny_llama, num_gpu_blocks_override=64)
    quiet = llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    shown = llm.generate(["a", "b"], GREEDY)  # vLLM's default
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in quiet]


def test_penalties_and_min_p_reach_the_engine(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, num_gpu_blocks_override=64)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(plain)) < len(plain)  # a tiny random model repeats itself
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=2.0)
    spread = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(spread)) > len(set(plain))  # fewer repeats
    keep_top = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=16, ignore_eos=True)
    assert llm.generate(prompt, keep_top, use_tqdm=False)[0].outputs[0].token_ids == plain
