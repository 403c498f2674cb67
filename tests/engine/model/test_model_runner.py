"""ModelRunner: chunked prefill, cached prefixes, mixed batches, block tables, dtypes, budgets."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from shoal.engine.model.model_runner import ModelRunner, resolve_dtype
from shoal.engine.protocol import SamplingParams
from shoal.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tests.engine.model_utils import (
    BlockPool,
    Driver,
    RecordingSampler,
    arch_from_hf,
    assert_logits_close,
    make_hf_model,
    make_request,
    make_runner,
    random_prompts,
)

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def hf_llama():
    return make_hf_model("LlamaForCausalLM", seed=7)


def _runner(hf_model, **kwargs) -> tuple[ModelRunner, RecordingSampler]:
    runner = make_runner(hf_model, block_size=BLOCK_SIZE, **kwargs)
    recorder = RecordingSampler()
    runner.sampler = recorder
    return runner, recorder


def _alone(hf_model, prompt: list[int], max_new_tokens: int, **kwargs) -> tuple[list[int], list]:
    """Greedy tokens and logits of one request run by itself, prefilled in one step."""
    runner, recorder = _runner(hf_model, **kwargs)
    request = make_request("alone", prompt)
    tokens = Driver(runner, BlockPool(runner.num_blocks)).generate([request], max_new_tokens)
    return tokens["alone"], recorder.logits["alone"]


def test_chunked_prefill_equals_full_prefill(hf_llama) -> None:
    prompt = random_prompts([30], seed=1)[0]
    ref_tokens, ref_logits = _alone(hf_llama, prompt, 4)
    runner, recorder = _runner(hf_llama)
    request = make_request("chunked", prompt)
    driver = Driver(runner, BlockPool(runner.num_blocks))
    for chunk in (10, 10):  # two chunks that do not reach the end: nothing is sampled
        assert driver.step([driver.schedule(request, chunk)]) == {}
    tokens = driver.generate([request], 4)  # the last 10 tokens, then decode
    assert tokens["chunked"] == ref_tokens
    assert_logits_close(recorder.logits["chunked"], ref_logits)


def test_prefix_already_in_blocks(hf_llama) -> None:
    prefix, tail_a, tail_b = random_prompts([16, 5, 7], seed=2)
    runner, recorder = _runner(hf_llama)
    pool = BlockPool(runner.num_blocks)
    driver = Driver(runner, pool)
    first = make_request("first", prefix + tail_a)
    driver.generate([first], 1)
    # The second request finds the prefix's 4 full blocks cached and computes only its tail.
    second = make_request("second", prefix + tail_b)
    second.num_computed_tokens = len(prefix)
    driver.block_ids["second"] = driver.block_ids["first"][: len(prefix) // BLOCK_SIZE]
    tokens = driver.generate([second], 5)
    ref_tokens, ref_logits = _alone(hf_llama, prefix + tail_b, 5)
    assert tokens["second"] == ref_tokens
    assert_logits_close(recorder.logits["second"], ref_logits)


def test_mixed_prefill_and_decode_batch_equals_each_alone(hf_llama) -> None:
    prompts = random_prompts([9, 21, 13], seed=3)
    refs = [_alone(hf_llama, p, 6) for p in prompts]
    runner, recorder = _runner(hf_llama)
    driver = Driver(runner, BlockPool(runner.num_blocks))
    requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    driver.generate(requests[:1], 3)  # r0 is decoding when the others arrive
    # r1 prefills in two chunks while r0 decodes; r2 joins for the second chunk.
    driver.step([driver.schedule(requests[0], 1), driver.schedule(requests[1], 12)])
    driver.step([driver.schedule(r, r.num_tokens - r.num_computed_tokens) for r in requests])
    while any(r.num_output_tokens < 6 for r in requests):
        active = [r for r in requests if r.num_output_tokens < 6]
        driver.step([driver.schedule(r, 1) for r in active])
    for i, (ref_tokens, ref_logits) in enumerate(refs):
        assert requests[i].output_token_ids == ref_tokens
        assert_logits_close(recorder.logits[f"r{i}"], ref_logits)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "TORCH_SDPA"])
def test_shuffled_block_tables_and_very_different_contexts(hf_llama, backend: str) -> None:
    # Very different context lengths, non-contiguous shuffled blocks: each request's tokens
    # are its tokens alone, through either CPU backend.
    prompts = random_prompts([3, 60, 25, 8, 41], seed=4)
    runner, recorder = _runner(hf_llama, attention_backend=backend)
    requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    pool = BlockPool(runner.num_blocks, shuffle_seed=0)
    tokens = Driver(runner, pool).generate(requests, 5)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = _alone(hf_llama, prompt, 5)
        assert tokens[f"r{i}"] == ref_tokens
        assert_logits_close(recorder.logits[f"r{i}"], ref_logits)


def test_bfloat16_roughly_matches_float32(hf_llama) -> None:
    prompt = random_prompts([24], seed=5)[0]
    tokens32, logits32 = _alone(hf_llama, prompt, 4)
    tokens16, logits16 = _alone(hf_llama, prompt, 4, dtype="bfloat16")
    assert tokens16[0] == tokens32[0]
    for a, b in zip(logits16, logits32, strict=False):
        assert a.dtype == torch.float32  # the sampler always sees float32
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
        assert (a - b).abs().max() < 0.1 * b.abs().max()


def test_mixtral_mixed_batch_equals_alone() -> None:
    hf_model = make_hf_model("MixtralForCausalLM", seed=8)
    prompts = random_prompts([11, 4, 19], seed=6)
    runner, _ = _runner(hf_model)
    requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    tokens = Driver(runner, BlockPool(runner.num_blocks, shuffle_seed=1)).generate(requests, 4)
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == _alone(hf_model, prompt, 4)[0]


def test_logprobs_and_sampling_params_reach_the_sampler(hf_llama) -> None:
    runner, recorder = _runner(hf_llama)
    params = SamplingParams(temperature=0.0, logprobs=3)
    request = make_request("lp", random_prompts([6], seed=9)[0], params)
    driver = Driver(runner, BlockPool(runner.num_blocks))
    out = runner.execute_model(SchedulerOutput([driver.schedule(request, 6)]))
    entry = out.logprobs["lp"]
    expected = torch.log_softmax(recorder.logits["lp"][0], dim=-1)
    assert entry.token_ids[0] == out.sampled_token_ids["lp"] == int(expected.argmax())
    assert entry.sampled_rank == 1
    assert entry.token_ids[1:] == expected.topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), expected.topk(3).values)


def test_empty_step_and_non_sampling_chunk(hf_llama) -> None:
    runner, _ = _runner(hf_llama)
    assert runner.execute_model(SchedulerOutput([])).sampled_token_ids == {}
    request = make_request("partial", random_prompts([12], seed=10)[0])
    scheduled = ScheduledRequest(request, 8, [0, 1, 2])
    assert not scheduled.samples
    out = runner.execute_model(SchedulerOutput([scheduled]))
    assert out.sampled_token_ids == {} and out.logprobs == {}


def _bare_runner(hf_llama, **cache_kwargs) -> ModelRunner:
    return ModelRunner(
        ModelConfig(model="unused"),
        CacheConfig(block_size=16, **cache_kwargs),
        SchedulerConfig(),
        arch_from_hf(hf_llama),
        max_model_len=128,
    )


def test_determine_num_blocks(hf_llama) -> None:
    # 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token.
    runner = _bare_runner(hf_llama)
    assert runner.bytes_per_block() == 16 * 512
    assert runner.determine_num_blocks() == (1 << 30) // (16 * 512)  # CPU default: 1 GiB
    budget = 10 * 16 * 512 + 7
    assert _bare_runner(hf_llama, kv_cache_memory_bytes=budget).determine_num_blocks() == 10
    assert _bare_runner(hf_llama, num_gpu_blocks_override=3).determine_num_blocks() == 3
    with pytest.raises(ValueError, match="holds no block"):
        _bare_runner(hf_llama, kv_cache_memory_bytes=100).determine_num_blocks()


def test_kv_cache_is_one_zeroed_pool(hf_llama) -> None:
    runner = _bare_runner(hf_llama)
    runner.initialize_kv_cache(5)
    assert runner.kv_cache is not None
    assert runner.kv_cache.shape == (2, 2, 2, 5, 16, 16)
    assert not runner.kv_cache.any()


def test_dtype_resolution(hf_llama) -> None:
    arch = arch_from_hf(hf_llama)
    cpu = torch.device("cpu")
    half_arch = type(arch)(**{**arch.__dict__, "torch_dtype": "float16"})
    bf16_arch = type(arch)(**{**arch.__dict__, "torch_dtype": "bfloat16"})
    assert resolve_dtype("auto", half_arch, cpu) == torch.float32
    assert resolve_dtype("auto", bf16_arch, cpu) == torch.bfloat16
    assert resolve_dtype("float32", bf16_arch, cpu) == torch.float32
    assert resolve_dtype("auto", half_arch, torch.device("cuda")) == torch.float16
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", arch, cpu)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "TORCH_SDPA"])
def test_every_cpu_backend_gives_hfs_tokens_chunked_cached_and_batched(
    hf_llama, backend: str
) -> None:
    # One step holds several prefill chunks at once: whole prompts, a later chunk of a prompt
    # (attending its earlier chunk in the cache), a cached prefix's tail, beside decodes.
    prompts = random_prompts([9, 33, 14, 1, 22], seed=11)
    runner, recorder = _runner(hf_llama, attention_backend=backend)
    assert runner.attention_backend.name == backend
    driver = Driver(runner, BlockPool(runner.num_blocks, shuffle_seed=3))
    requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    driver.generate(requests[:1], 2)  # r0 decodes while the rest prefill
    driver.step([driver.schedule(requests[0], 1)] + [driver.schedule(r, 7) for r in requests[1:3]])
    tokens = driver.generate(requests, 5, chunk_size=10)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = _alone(hf_llama, prompt, 5)
        assert tokens[f"r{i}"] == ref_tokens
        assert_logits_close(recorder.logits[f"r{i}"], ref_logits)
