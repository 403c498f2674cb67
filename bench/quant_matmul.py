"""Matmuls from GGUF blocks against the dense fp32 weights, at each step size.

Every projection of SmolLM2-135M (the 210 of its 30 layers, then the LM head) is multiplied
by an [M, K] input, once from its Q4_1 / Q8_0 blocks with the CPU kernel
(`engine/kernels/quant_matmul.py`) and once from the oneDNN-packed fp32 weights the engine
uses otherwise, alternating, best of `--repeats`. A pass over all layers reads every weight
once, as a decode step does, so the weights come from memory, not from cache. On x86 the
kernel's builds without AVX-512 (integer dot products on 16-bit activations) and without AVX2
(the float path) run as further columns. The crossover is
where `shoal_quant_max_rows` in `engine/kernels/csrc/quant_matmul.c` comes from.

    .venv/bin/python bench/quant_matmul.py [--rows 1,2,4,8,16,32,64,128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.cpu import cpu_kind
from shoal.engine.kernels.paged_attention import ISA_CFLAGS, build_kernel
from shoal.engine.kernels.quant_matmul import (
    SOURCE_PATH,
    QuantizedWeight,
    QuantMatmulKernel,
    load_quant_kernel,
)
from shoal.engine.loader import load_blocks, load_weights, smollm2_gguf_path
from shoal.engine.model.layers import pack_weight, packed_linear

HEAD = "model.embed_tokens.weight"  # tied: the LM head's weights


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_dense(pairs: list[tuple[torch.Tensor, str]], dense: dict[str, torch.Tensor]) -> None:
    for x, name in pairs:
        packed_linear(x, dense[name])


def run_blocks(
    pairs: list[tuple[torch.Tensor, str]],
    blocks: dict[str, QuantizedWeight],
    kernel: QuantMatmulKernel,
) -> None:
    for x, name in pairs:
        kernel.linear(x, blocks[name], None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,12,16,32,48,64,96,128")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    native = load_quant_kernel()
    if native is None:
        raise SystemExit("the CPU kernel cannot be built here")
    kernels: dict[str, QuantMatmulKernel] = {"blocks": native}
    if platform.machine() in ("x86_64", "AMD64"):
        # The builds SHOAL_CPU_ISA selects: without AVX-512 (16-bit activations, integer dot
        # products) and without AVX2 (the float path).
        cache = Path(tempfile.mkdtemp(prefix="shoal-kernels-"))
        for isa in ("avx2", "avx"):
            path = build_kernel(cache, extra_cflags=ISA_CFLAGS[isa], source_path=SOURCE_PATH)
            kernels[f"isa={isa}"] = QuantMatmulKernel(path)
    path = smollm2_gguf_path()
    blocks = dict(load_blocks(path) or [])
    dense = {name: pack_weight(t) for name, t in load_weights(path) if name in blocks}
    layers = [name for name in blocks if name != HEAD]
    print(
        f"{len(layers)} layer projections + LM head, {torch.get_num_threads()} threads; "
        "max_rows / int_rows: "
        + ", ".join(
            f"{k} {v.max_rows} / {v.int_rows if v.int_rows < 1 << 30 else 'all'}"
            for k, v in kernels.items()
        )
    )
    header = "".join(f"{k + ' ms':>14s}" for k in kernels)
    print(f"{'part':8s}{'rows':>6s}{'dense ms':>11s}{header}   dense / each")
    for num_rows in map(int, args.rows.split(",")):
        inputs = {k: torch.randn(num_rows, k) for k in {blocks[n].in_features for n in blocks}}
        for part, names in (("layers", layers), ("lm_head", [HEAD])):
            pairs = [(inputs[blocks[n].in_features], n) for n in names]
            dense_s = best_of(args.repeats, partial(run_dense, pairs, dense))
            each = {
                k: best_of(args.repeats, partial(run_blocks, pairs, blocks, kernel))
                for k, kernel in kernels.items()
            }
            cells = "".join(f"{t * 1e3:14.1f}" for t in each.values())
            ratios = ", ".join(f"{dense_s / t:.2f}x" for t in each.values())
            print(f"{part:8s}{num_rows:6d}{dense_s * 1e3:11.1f}{cells}   {ratios}")


if __name__ == "__main__":
    main()
