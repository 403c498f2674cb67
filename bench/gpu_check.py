"""The device check's figures (run by bench/gpu_check.sh on a GPU machine, no Ray): greedy tokens
against HF in bf16 for a dense Llama (Llama-3.2-1B's shape) and a Mixtral (Mixtral-8x7B's layer
shape, fewer layers), random weights; TRITON_ATTN against the torch reference at those attention
shapes; decode step time and offline throughput, each beside the HBM-bandwidth bound.

    python3 bench/gpu_check.py --out table.md [--hbm-tbps 4.8] [--smoke]

--smoke runs tiny shapes on the CPU (Triton under its interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:  # Triton on CPU: its interpreter, chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import cpu_kind
from tests.engine.model.attention.cases import MIXED_CHUNKS, PagedStep
from tests.engine.model_utils import (
    BlockPool,
    Driver,
    RecordingSampler,
    make_request,
    make_runner,
)

LLAMA_1B: dict[str, Any] = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
MIXTRAL_4L: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    rope_theta=1e6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
SMOKE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def build_hf(architecture: str, config: dict[str, Any], device: str) -> Any:
    """A random HF model in bf16 on `device` (init std 0.02 as HF's, so logits have margins
    only where weights say so: ties are reported, not hidden)."""
    torch.manual_seed(0)
    cls = getattr(transformers, architecture)
    cfg = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**config)
    with torch.device(device):
        return cls(cfg).to(torch.bfloat16).eval()


def hf_tokens(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def greedy_vs_hf(model: Any, runner: Any, prompts: list[list[int]], n: int) -> str:
    runner.sampler = RecordingSampler()
    requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    ours = Driver(runner, BlockPool(runner.num_blocks)).generate(requests, n)
    same = prefix = 0
    for i, prompt in enumerate(prompts):
        ref = hf_tokens(model, prompt, n)
        mine = ours[f"r{i}"]
        same += mine == ref
        prefix += next((j for j, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b), n)
    return f"{same}/{len(prompts)} identical, mean common prefix {prefix / len(prompts):.1f}/{n}"


def triton_vs_reference(device: str, num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    from shoal.engine.model.attention import select_attention_backend
    from shoal.engine.model.attention.torch_sdpa import TorchSDPABackend

    chunks = MIXED_CHUNKS + [(2000, 1)] * 8 + [(0, 700), (1500, 300)]
    errors = []
    for dtype in (torch.float32, torch.bfloat16):
        step = PagedStep(
            chunks,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=16,
            dtype=dtype,
            device=device,
        )
        backend = select_attention_backend(
            "TRITON_ATTN",
            device=torch.device(device),
            dtype=dtype,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        out, pool = step.run(backend)
        ref, ref_pool = step.run(TorchSDPABackend())
        assert torch.equal(pool, ref_pool), "K/V written to other slots"
        errors.append(
            f"{str(dtype)[6:]} max|err| {float((out.float() - ref.float()).abs().max()):.2e}"
        )
    return ", ".join(errors)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_step_time(runner: Any, batch: int, context: int, device: str, vocab: int) -> float:
    """Median seconds of one decode step of `batch` requests at `context` tokens."""
    prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(context)] for i in range(batch)]
    requests = [make_request(f"d{i}", p) for i, p in enumerate(prompts)]
    driver = Driver(runner, BlockPool(runner.num_blocks))
    for group in range(0, batch, 16):  # prefill 16 at a time: steps of at most 16 x context
        driver.generate(requests[group : group + 16], 1)
    times = []
    for _ in range(8):
        scheduled = [driver.schedule(r, 1) for r in requests]
        sync(device)
        start = time.perf_counter()
        driver.step(scheduled)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def offline_throughput(
    runner: Any, num: int, prompt_len: int, out_len: int, device: str, vocab: int
) -> float:
    prompts = [[(11 * i + j) % (vocab - 1) + 1 for j in range(prompt_len)] for i in range(num)]
    requests = [make_request(f"o{i}", p) for i, p in enumerate(prompts)]
    driver = Driver(runner, BlockPool(runner.num_blocks))
    sync(device)
    start = time.perf_counter()
    driver.generate(requests, out_len, chunk_size=2048)
    sync(device)
    return num * out_len / (time.perf_counter() - start)


def weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def step_weight_bytes(model: Any, config: dict[str, Any], batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens reads: all of a dense model; of an MoE,
    the experts that some token routes to (expected share, uniform routing)."""
    total = weight_bytes(model)
    num_experts = config.get("num_local_experts")
    if not num_experts:
        return total
    experts = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )
    touched = 1 - (1 - config["num_experts_per_tok"] / num_experts) ** batch
    return total - experts * (1 - touched)


def check_model(
    name: str, arch: str, config: dict[str, Any], args: argparse.Namespace
) -> list[str]:
    device = "cpu" if args.smoke else "cuda"
    vocab = config["vocab_size"]
    model = build_hf(arch, config, device)
    runner = make_runner(
        model,
        block_size=16,
        num_blocks=args.num_blocks,
        dtype="bfloat16",
        max_num_batched_tokens=8192,
        device=device,
    )
    rows = [f"| {name} | attention backend | {runner.attention_backend.name} |"]
    prompts = [
        [(13 * i + 5 * j) % (vocab - 1) + 1 for j in range(n)]
        for i, n in enumerate([5, 64, 300, 1])
    ]
    rows.append(f"| {name} | greedy vs HF, bf16 | {greedy_vs_hf(model, runner, prompts, 16)} |")
    hbm = args.hbm_tbps * 1e12
    kv_per_token = runner.bytes_per_block() // runner.block_size
    for batch in args.batches:
        t = decode_step_time(runner, batch, args.context, device, vocab)
        bound = (
            step_weight_bytes(model, config, batch) + batch * args.context * kv_per_token
        ) / hbm
        rows.append(
            f"| {name} | decode step, batch {batch}, context {args.context} | "
            f"{t * 1e3:.2f} ms (HBM bound {bound * 1e3:.2f} ms, {bound / t:.0%}) |"
        )
    tps = offline_throughput(
        runner, args.num_requests, args.prompt_len, args.output_len, device, vocab
    )
    avg_context = args.prompt_len + args.output_len // 2
    step_bytes = step_weight_bytes(model, config, args.num_requests)
    bound_tps = args.num_requests / (
        (step_bytes + args.num_requests * avg_context * kv_per_token) / hbm
    )
    rows.append(
        f"| {name} | offline, {args.num_requests} x ({args.prompt_len} in, {args.output_len} out) | "
        f"{tps:.0f} tok/s (decode HBM bound ~{bound_tps:.0f} tok/s) |"
    )
    heads = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]),
    )
    rows.append(f"| {name} | TRITON_ATTN vs TORCH_SDPA | {triton_vs_reference(device, *heads)} |")
    del runner, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="H200: 4.8 TB/s")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    if args.smoke:
        args.batches, args.context, args.num_requests, args.output_len = [2], 40, 3, 4
        args.prompt_len = 24
        args.num_blocks = 256
        models = [("tiny llama", "LlamaForCausalLM", SMOKE)]
    else:
        args.batches, args.context, args.num_requests, args.output_len = [1, 32, 128], 1024, 64, 128
        args.num_blocks = 16384
        args.prompt_len = 512
        models = [
            ("Llama-3.2-1B shape", "LlamaForCausalLM", LLAMA_1B),
            ("Mixtral-8x7B layers x4", "MixtralForCausalLM", MIXTRAL_4L),
        ]
    rows = ["| model | check | result |", "| --- | --- | --- |"]
    for name, arch, config in models:
        rows += check_model(name, arch, config, args)
        print("\n".join(rows), flush=True)
    args.out.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
