"""The newer architectures against HF transformers, through the whole engine (`LLM`): tiny
random checkpoints saved by transformers, greedy tokens equal to HF's for prompts longer than
the sliding window, run several at once, chunked, one of them over a cached prefix; on each
attention backend that serves the model; and the GGUF llama.cpp would write for them."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch.distributed import TCPStore

from shoal.client.api.llm import LLM
from shoal.engine.kv_cache import FREED_BLOCK
from shoal.engine.loader import load_model_arch, load_weights
from shoal.engine.model_arch import ARCHITECTURE_SUPPORT
from shoal.engine.protocol import SamplingParams
from tests.factories import Arch, hf_reference, make_tiny_checkpoint, make_tiny_gguf
from tests.reference import assert_greedy_matches, hf_greedy

MAX_TOKENS = 10
# Newer architectures -> what they bring that the engine had to learn.
ARCHITECTURES: dict[Arch, str] = {
    "qwen3": "q/k norms, head_dim apart from hidden / heads",
    "mistral": "a sliding window on every layer (its KV blocks freed as requests pass it)",
    "qwen3_moe": "routed experts, top-k renormalised (norm_topk_prob), a dense layer among them",
    "gemma3": "sandwich norms, scaled embeddings, local/global layers with their own rope bases",
    "phi3": "fused qkv and gate_up tensors, a sliding window",
    "gpt_oss": "attention sinks, alternating windows, biased and clamped experts, yarn rope",
    "deepseek_v3": "latent attention over a cache of the latent, grouped routing, shared experts",
}
MOE: tuple[Arch, ...] = ("qwen3_moe", "gpt_oss", "deepseek_v3")
# Beyond the defaults: three layers give Qwen3-MoE a dense layer among its MoE ones.
CHECKPOINT_KWARGS: dict[str, dict[str, Any]] = {"qwen3_moe": {"num_layers": 3}}
WINDOWED: tuple[Arch, ...] = ("mistral", "phi3", "gemma3", "gpt_oss")
GGUF: tuple[Arch, ...] = ("qwen2", "qwen3", "qwen3_moe", "gemma3", "phi3", "gpt_oss")
# What llama.cpp fixes in code, a checkpoint must match for its GGUF to be the same model:
# Gemma 3's five sliding layers to one global one, scores scaled by head_dim ** -0.5.
GGUF_CHECKPOINT_KWARGS: dict[str, dict[str, Any]] = {
    "gemma3": {
        "num_layers": 6,
        "config_overrides": {"layer_types": None, "query_pre_attn_scalar": 16},
    }
}


def prompts(seed: int = 3) -> tuple[list[int], list[list[int]]]:
    """(a 26-token prefix, three prompts): two share the prefix, all are over 30 tokens, far
    past the tiny checkpoints' window of 12."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(1, 500, (n,), generator=gen).tolist()

    prefix = draw(26)
    return prefix, [prefix + draw(6), draw(33), prefix + draw(11)]


def generate(llm: LLM, batch: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def engine(path: str, **kwargs: Any) -> LLM:
    """An in-process engine with small blocks and a step budget below the prompts' lengths:
    every prompt is prefilled in chunks, beside the others' chunks and decodes."""
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("max_num_batched_tokens", 16)
    return LLM(path, dtype="float32", max_model_len=128, **kwargs)


def assert_engine_matches_hf(llm: LLM, hf_model: Any) -> None:
    """A first prompt fills the prefix cache; then three prompts run at once, chunked, one of
    them found in the cache up to its prefix's full blocks; every token equals HF's."""
    prefix, batch = prompts()
    generate(llm, [[*prefix, 7]])
    outputs = generate(llm, batch)
    assert outputs[0].num_cached_tokens == outputs[2].num_cached_tokens == 24
    for i, (prompt, output) in enumerate(zip(batch, outputs, strict=True)):
        tokens = list(output.outputs[0].token_ids)
        assert_greedy_matches(tokens, hf_greedy(hf_model, prompt, MAX_TOKENS), label=f"p{i}")


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    arch = request.param
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp(arch), arch, **CHECKPOINT_KWARGS.get(arch, {})
    )


@pytest.mark.parametrize("backend", ["CPU_ATTN", "TORCH_SDPA"])
def test_greedy_tokens_equal_hfs_batched_chunked_and_over_a_cached_prefix(
    checkpoint: str, backend: str
) -> None:
    hf_model = hf_reference(checkpoint)
    llm = engine(checkpoint, attention_backend=backend)
    try:
        assert_engine_matches_hf(llm, hf_model)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", WINDOWED)
def test_the_window_shapes_the_tokens_and_frees_blocks_where_every_layer_slides(
    tmp_path: Path, arch: Arch
) -> None:
    path = make_tiny_checkpoint(tmp_path, arch)
    model_arch = load_model_arch(path)
    window = model_arch.sliding_window
    assert window is not None
    _, batch = prompts()
    unwindowed = hf_reference(path)
    unwindowed.config.sliding_window = 4096  # the same weights, seeing every position
    hf_model = hf_reference(path)
    differs = [
        hf_greedy(hf_model, p, MAX_TOKENS).token_ids
        != hf_greedy(unwindowed, p, MAX_TOKENS).token_ids
        for p in batch
    ]
    assert any(differs), "the prompts do not reach past the window"
    # Where every layer slides, the scheduler frees the blocks that fall out of the window as
    # a request advances: the most it holds is a window and a chunk's worth, not the sequence.
    # Where global layers read every position, blocks stay.
    every_layer_slides = model_arch.kv_window is not None
    assert every_layer_slides == (arch in ("mistral", "phi3"))
    llm = engine(path, enable_prefix_caching=False)
    kv = cast(Any, llm)._driver.engine_core.scheduler.kv_cache_manager
    assert kv.sliding_window == model_arch.kv_window
    held: list[int] = []
    allocate = kv.allocate_slots

    def recording_allocate(request: Any, *args: Any, **kwargs: Any) -> bool:
        done = allocate(request, *args, **kwargs)
        held.append(sum(b != FREED_BLOCK for b in kv.get_block_ids(request.request_id)))
        return bool(done)

    kv.allocate_slots = recording_allocate
    try:
        [output] = generate(llm, [batch[1]])
    finally:
        llm.shutdown()
    tokens = list(output.outputs[0].token_ids)
    assert_greedy_matches(tokens, hf_greedy(hf_model, batch[1], MAX_TOKENS), label="long")
    block_size, chunk = 4, 16
    num_blocks = -(-(len(batch[1]) + MAX_TOKENS - 1) // block_size)
    if every_layer_slides:
        assert max(held) <= -(-(window - 1 + chunk) // block_size) + 1 < num_blocks
    else:
        assert max(held) == num_blocks


@pytest.mark.parametrize("arch", GGUF)
def test_gguf_loads_the_hf_weights_and_generates_hfs_tokens(tmp_path: Path, arch: Arch) -> None:
    import gguf

    checkpoint = make_tiny_checkpoint(tmp_path / "hf", arch, **GGUF_CHECKPOINT_KWARGS.get(arch, {}))
    exact = make_tiny_gguf(tmp_path / "f32.gguf", checkpoint, qtype="F32")
    ours, expected = dict(load_weights(exact)), dict(load_weights(checkpoint))
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        # Gemma's norms travel as 1 + w (llama.cpp's): the sum rounds once, by half an ulp of 2.
        atol = 2**-23 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=atol, msg=name)
    assert load_model_arch(exact).architecture == load_model_arch(checkpoint).architecture
    # Q8_0 blocks: the engine computes decode steps from them; HF gets the same values,
    # dequantized by the gguf package from what the file holds.
    quantized = make_tiny_gguf(tmp_path / "q8.gguf", checkpoint, qtype="Q8_0")
    hf_model = hf_reference(checkpoint)
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.dim() == 2:
                blocks = gguf.quants.quantize(param.numpy(), q8)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, q8)))
    llm = engine(quantized)
    try:
        assert_engine_matches_hf(llm, hf_model)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_two_tensor_parallel_workers_give_hfs_tokens(checkpoint: str) -> None:
    hf_model = hf_reference(checkpoint)
    llm = engine(checkpoint, tensor_parallel_size=2)
    try:
        assert_engine_matches_hf(llm, hf_model)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield int(master.port)


@pytest.mark.parametrize("arch", MOE)
def test_two_expert_parallel_ranks_give_hfs_tokens(
    tmp_path: Path, arch: Arch, store_port: int
) -> None:
    from tests.engine.parallel.test_expert_parallel import ep_engines

    path = make_tiny_checkpoint(tmp_path, arch, **CHECKPOINT_KWARGS.get(arch, {}))
    hf_model = hf_reference(path)
    _, batch = prompts(seed=5)
    with ep_engines(path, 2, store_port) as cluster:
        tokens = cluster.generate(batch, max_tokens=MAX_TOKENS)
    for i, (prompt, got) in enumerate(zip(batch, tokens, strict=True)):
        assert_greedy_matches(got, hf_greedy(hf_model, prompt, MAX_TOKENS), label=f"p{i}")


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_the_triton_kernels_serve_sinks_windows_and_latents(tmp_path: Path, arch: Arch) -> None:
    """TRITON_ATTN (interpreted on CPU, compiled on a GPU) through the whole engine."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA, Triton runs compiled: the GPU suite covers it")
    path = make_tiny_checkpoint(tmp_path, arch)
    llm = engine(path, attention_backend="TRITON_ATTN")
    try:
        assert_engine_matches_hf(llm, hf_reference(path))
    finally:
        llm.shutdown()


def test_latent_attention_caches_the_latent_and_its_rotary_part_only(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "deepseek_v3")
    arch = load_model_arch(path)
    llm = engine(path)
    try:
        [block_bytes] = cast(Any, llm)._driver.engine_core.collective_rpc("bytes_per_block")
    finally:
        llm.shutdown()
    row = arch.kv_lora_rank + arch.qk_rope_head_dim  # 32 + 8 floats per token and layer
    assert block_bytes == arch.num_hidden_layers * 4 * row * 4
    expanded = 2 * arch.num_attention_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim)
    assert row * 4 < expanded  # what caching K and V per head would take


def test_serve_help_lists_every_architecture_and_what_it_supports() -> None:
    import argparse

    from shoal.deploy.serve import add_serve_args

    parser = argparse.ArgumentParser(prog="shoal serve")
    add_serve_args(parser)
    text = " ".join(parser.format_help().split())
    for name, support in ARCHITECTURE_SUPPORT.items():
        assert f"{name} ({support})" in text, name


@pytest.mark.parametrize("arch", MOE)
def test_restaged_experts_equal_those_loaded_for_the_new_placement(
    tmp_path: Path, arch: Arch
) -> None:
    """Elastic EP's re-staging reads each architecture's expert names and layout."""
    from shoal.engine.model.experts import RoutedExperts
    from shoal.engine.model.registry import get_model_class
    from shoal.engine.parallel.expert_parallel import ExpertParallel, ExpertPlacement

    path = make_tiny_checkpoint(tmp_path, arch)
    model_arch = load_model_arch(path)
    num_experts = model_arch.num_local_experts

    def build(placement: ExpertPlacement, rank: int) -> Any:
        model = get_model_class(model_arch.architecture)(
            model_arch, expert_parallel=ExpertParallel(placement, rank)
        )
        model.load_weights(load_weights(path))
        return model

    old, new = (
        ExpertPlacement.contiguous(num_experts, 2),
        ExpertPlacement.contiguous(num_experts, 4),
    )
    model = build(old, 0)
    ep = model.expert_parallel
    ep.commit(ep.stage(new, 1, path))
    expected = build(new, 1)
    pairs = [
        (a, b)
        for a, b in zip(model.modules(), expected.modules(), strict=True)
        if isinstance(a, RoutedExperts)
    ]
    assert pairs
    for got, want in pairs:
        assert got.expert_ids == want.expert_ids == new.experts_of(1)
        for field in ("w13", "w2", "w13_bias", "w2_bias"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None), field
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=field)
