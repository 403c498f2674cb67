"""The C paged decode and prefill kernels against a dense float64 softmax(QK^T)V; their build
cache and loader; the fallback to the torch reference backend."""

from __future__ import annotations

import ast
import logging
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import shoal.engine.kernels.paged_attention as pak
from shoal.engine.kernels.paged_attention import (
    KernelBuildError,
    PagedDecodeKernel,
    build_kernel,
    load_decode_kernel,
)
from tests.engine.model_utils import (
    BlockPool,
    Driver,
    RecordingSampler,
    assert_logits_close,
    make_hf_model,
    make_request,
    make_runner,
    random_prompts,
)
from tests.tolerances import reordering_gamma


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    k = load_decode_kernel()
    assert k is not None, "the kernel must build where the tests run (cc and OpenMP)"
    return k


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    """Forgets the process-wide kernel so a test can load (or fail to load) it again."""
    pak._load_once.cache_clear()
    yield
    pak._load_once.cache_clear()


class Case:
    """A K/V pool [2, KVH, blocks, block_size, D] with random contents, shuffled block tables
    for `context_lens`, and one query per sequence."""

    def __init__(
        self,
        context_lens: list[int],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.context_lens = context_lens
        blocks_needed = [-(-n // block_size) for n in context_lens]
        num_blocks = sum(blocks_needed) + 7  # spare blocks the tables never name
        pool = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
        self.pool = pool.to(dtype)
        free = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(blocks_needed)
        table = np.zeros((len(context_lens), width), dtype=np.int64)
        for i, n in enumerate(blocks_needed):
            table[i, :n], free = free[:n], free[n:]
        self.block_table = table
        self.query = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
        self.scale = head_dim**-0.5

    def run_kernel(
        self, kernel: PagedDecodeKernel, *, partition_blocks: int = 4, num_threads: int = 2
    ) -> torch.Tensor:
        out = torch.full_like(self.query, float("nan"))
        kernel.decode(
            out,
            self.query,
            self.pool[0],
            self.pool[1],
            torch.from_numpy(self.block_table.astype(np.int32)),
            torch.tensor(self.context_lens, dtype=torch.int32),
            scale=self.scale,
            partition_blocks=partition_blocks,
            num_threads=num_threads,
        )
        return out

    def reference(self) -> torch.Tensor:
        """softmax(scale * q K^T) V per sequence in float64, K/V read through the table."""
        num_heads, num_kv_heads = self.query.shape[1], self.pool.shape[1]
        rows = []
        for i, n in enumerate(self.context_lens):
            ids = torch.from_numpy(self.block_table[i, : -(-n // self.block_size)])
            kv = self.pool[:, :, ids].double().flatten(2, 3)[:, :, :n]  # [2, KVH, n, D]
            kv = kv.repeat_interleave(num_heads // num_kv_heads, dim=1)
            scores = torch.einsum("hd,htd->ht", self.query[i].double(), kv[0]) * self.scale
            rows.append(torch.einsum("ht,htd->hd", scores.softmax(-1), kv[1]))
        return torch.stack(rows)


def _assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max abs error within `rel` of the largest magnitude (outputs are averages of V rows)."""
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max error {err}"


CONTEXTS = [1, 600, 48, 17, 16, 333, 2, 599, 250, 64]  # 48, 16, 64: whole blocks of 16
# fp32 sides differ from each other and from the float64 reference by reordered sums: scores
# over head_dim (at most 128), the softmax's normaliser and the weighted sum over the context
# (tests/tolerances.py). bfloat16 sides compute in fp32 from the same bf16 K/V and round what
# they keep to bf16: within a few bf16 epsilons.
FP32_REL = reordering_gamma(torch.float32, 2 * max(CONTEXTS) + 128)
BF16_EPS = torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_fp32_matches_dense_reference(kernel, head_dim: int, group: int) -> None:
    case = Case(CONTEXTS, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, seed=group)
    _assert_close_rel(case.run_kernel(kernel), case.reference(), FP32_REL)


def test_odd_head_dim_and_block_size(kernel) -> None:
    # head_dim 80 leaves a 16-lane remainder path and 72 a scalar tail; block_size 5 makes
    # tiles straddle blocks.
    for head_dim in (80, 72):
        case = Case([1, 7, 301, 45], num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=5)
        _assert_close_rel(case.run_kernel(kernel), case.reference(), FP32_REL)


def test_bf16_pool_is_widened_exactly(kernel) -> None:
    case = Case(CONTEXTS, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    # The reference reads the same bf16 values: only fp32 accumulation separates the two.
    _assert_close_rel(case.run_kernel(kernel), case.reference(), FP32_REL)


def test_partitions_threads_and_strided_query(kernel) -> None:
    case = Case([600, 250, 1, 96], num_heads=8, num_kv_heads=2, head_dim=64, seed=3)
    expected = case.reference()
    for partition_blocks in (1, 3, 1000):
        for num_threads in (1, 3):
            out = case.run_kernel(
                kernel, partition_blocks=partition_blocks, num_threads=num_threads
            )
            _assert_close_rel(out, expected, FP32_REL)
    # A query that is a view with a padded row stride, as the model's q slice is.
    padded = torch.zeros(4, 10, 64)
    padded[:, :8] = case.query
    case.query = padded[:, :8]
    _assert_close_rel(case.run_kernel(kernel), expected, FP32_REL)


def test_rejects_an_empty_context(kernel) -> None:
    case = Case([5, 5], num_heads=2, num_kv_heads=1, head_dim=64)
    case.context_lens = [5, 0]
    with pytest.raises(RuntimeError, match="bad argument"):
        case.run_kernel(kernel)


def _cpu_has(*flags: str) -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            cpu_flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return all(flag in cpu_flags for flag in flags)


@pytest.mark.parametrize(
    "cflags",
    [
        # The shuffle-free fallback, for compilers without __builtin_shufflevector.
        ("-DSHOAL_PORTABLE",),
        # 8-lane vectors (AVX2) and 4-lane vectors (SSE, as on NEON), whatever this CPU has.
        pytest.param(
            ("-march=x86-64-v3",),
            marks=pytest.mark.skipif(not _cpu_has("avx2", "fma"), reason="needs x86 AVX2"),
        ),
        pytest.param(
            ("-march=x86-64-v2",),
            marks=pytest.mark.skipif(not _cpu_has("sse4_2"), reason="needs x86 SSE4.2"),
        ),
    ],
    ids=["portable", "avx2", "sse"],
)
def test_other_vector_widths_match(tmp_path: Path, cflags: tuple[str, ...]) -> None:
    other = PagedDecodeKernel(build_kernel(tmp_path, extra_cflags=cflags))
    case = Case(CONTEXTS, num_heads=6, num_kv_heads=2, head_dim=72, dtype=torch.bfloat16)
    _assert_close_rel(case.run_kernel(other), case.reference(), FP32_REL)
    case = Case(CONTEXTS, num_heads=4, num_kv_heads=4, head_dim=128, block_size=5)
    _assert_close_rel(case.run_kernel(other), case.reference(), FP32_REL)
    pre, query, starts = _prefill_case(PREFILL_CHUNKS, num_heads=6, num_kv_heads=2, head_dim=72)
    out = _run_prefill(other, pre, query, PREFILL_CHUNKS, starts)
    _assert_close_rel(out, _prefill_reference(pre, query, PREFILL_CHUNKS, starts), FP32_REL)


def test_disable_env_selects_the_torch_path(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_model = make_hf_model("LlamaForCausalLM", seed=3)
    prompts = random_prompts([3, 40, 17], seed=9)

    def generate() -> tuple[str, dict[str, list[int]], dict[str, list[torch.Tensor]]]:
        runner = make_runner(hf_model, block_size=4)
        runner.sampler = recorder = RecordingSampler()
        requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
        pool = BlockPool(runner.num_blocks, shuffle_seed=2)
        tokens = Driver(runner, pool).generate(requests, 6)
        return runner.attention_backend.name, tokens, recorder.logits

    used, tokens, logits = generate()
    assert used == "CPU_ATTN"
    monkeypatch.setenv(pak.DISABLE_ENV, "1")
    fallback, fallback_tokens, fallback_logits = generate()
    assert fallback == "TORCH_SDPA"
    assert fallback_tokens == tokens
    for rid, rows in logits.items():
        assert_logits_close(rows, fallback_logits[rid])


def test_build_is_cached_by_source_flags_and_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build_kernel(tmp_path)
    built_at = first.stat().st_mtime_ns
    assert build_kernel(tmp_path) == first and first.stat().st_mtime_ns == built_at
    monkeypatch.setenv(pak.CACHE_ENV, str(tmp_path))
    assert build_kernel() == first  # SHOAL_KERNEL_CACHE names the same directory
    other_flags = build_kernel(tmp_path, extra_cflags=("-DSHOAL_PORTABLE",))
    monkeypatch.setattr(pak, "_cpu_identity", lambda: b"another cpu")
    other_cpu = build_kernel(tmp_path)
    assert len({first, other_flags, other_cpu}) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (first, other_flags, other_cpu)
    )


def test_concurrent_builds_leave_one_complete_file(tmp_path: Path) -> None:
    paths: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            paths.append(build_kernel(tmp_path))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temp files left
    PagedDecodeKernel(paths[0])  # loads


def test_compile_error_is_a_build_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(KernelBuildError, match="failed"):
        build_kernel(tmp_path / "cache", source_path=bad)
    assert list((tmp_path / "cache").iterdir()) == []


def test_no_compiler_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_loader
) -> None:
    monkeypatch.setenv(pak.CACHE_ENV, str(tmp_path))  # an empty cache: it must compile
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with caplog.at_level(logging.WARNING, logger=pak.__name__):
        assert load_decode_kernel() is None
        assert load_decode_kernel() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C compiler" in warnings[0].getMessage()


def test_disable_env_wins_over_a_loaded_kernel(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_decode_kernel() is not None
    monkeypatch.setenv(pak.DISABLE_ENV, "1")
    assert load_decode_kernel() is None


_OPENMP_RUNTIMES = """
import torch
from shoal.engine.kernels.paged_attention import load_decode_kernel
assert load_decode_kernel() is not None
with open("/proc/self/maps") as f:
    print(sorted({line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_shares_torchs_openmp_runtime(kernel) -> None:
    # Two OpenMP runtimes would each keep a spinning thread pool and fight over the cores. A
    # fresh process holds only torch and the kernel: this one may have loaded other libraries
    # that bring their own runtime (sentencepiece's wheel does), which says nothing of ours.
    out = subprocess.run(
        [sys.executable, "-c", _OPENMP_RUNTIMES], capture_output=True, text=True, check=True
    )
    runtimes = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes
    assert "/torch/" in runtimes[0], runtimes


def _prefill_case(
    chunks: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[Case, torch.Tensor, list[int]]:
    """A pool and tables for chunks (start_pos, num_queries), and their flat query rows."""
    case = Case(
        [s + n for s, n in chunks],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(n for _, n in chunks), num_heads, head_dim, generator=gen)
    starts = np.cumsum([0] + [n for _, n in chunks])[:-1].tolist()
    return case, query, starts


def _prefill_reference(
    case: Case, query: torch.Tensor, chunks: list[tuple[int, int]], starts: list[int]
) -> torch.Tensor:
    """Causal softmax(scale q K^T) V in float64, each query over its sequence's [0, pos]."""
    num_heads, num_kv_heads = query.shape[1], case.pool.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, (start_pos, n) in enumerate(chunks):
        ctx = start_pos + n
        ids = torch.from_numpy(case.block_table[i, : -(-ctx // case.block_size)])
        kv = case.pool[:, :, ids].double().flatten(2, 3)[:, :, :ctx]
        kv = kv.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[starts[i] : starts[i] + n].double()
        scores = torch.einsum("qhd,htd->hqt", q, kv[0]) * case.scale
        visible = torch.arange(ctx)[None, :] <= torch.arange(start_pos, ctx)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[i] : starts[i] + n] = torch.einsum("hqt,htd->qhd", scores.softmax(-1), kv[1])
    return out


def _run_prefill(
    kernel: PagedDecodeKernel,
    case: Case,
    query: torch.Tensor,
    chunks: list[tuple[int, int]],
    starts: list[int],
    num_threads: int = 2,
) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))
    kernel.prefill(
        out,
        query,
        case.pool[0],
        case.pool[1],
        torch.from_numpy(case.block_table.astype(np.int32)),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([n for _, n in chunks], dtype=torch.int32),
        torch.tensor([s for s, _ in chunks], dtype=torch.int32),
        scale=case.scale,
        num_threads=num_threads,
    )
    return out


# (start_pos, queries): from scratch, later chunks over a cached past, one query, tile edges.
PREFILL_CHUNKS = [(0, 37), (20, 5), (100, 64), (3, 1), (0, 16), (15, 17), (0, 1), (250, 33)]


@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (128, 1), (72, 4)])
def test_prefill_matches_dense_causal_reference(kernel, head_dim: int, group: int) -> None:
    case, query, starts = _prefill_case(
        PREFILL_CHUNKS, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim
    )
    out = _run_prefill(kernel, case, query, PREFILL_CHUNKS, starts)
    _assert_close_rel(out, _prefill_reference(case, query, PREFILL_CHUNKS, starts), FP32_REL)


def test_prefill_bf16_pool_odd_block_size_one_thread(kernel) -> None:
    case, query, starts = _prefill_case(
        PREFILL_CHUNKS,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=5,
        dtype=torch.bfloat16,
    )
    out = _run_prefill(kernel, case, query, PREFILL_CHUNKS, starts, num_threads=1)
    _assert_close_rel(out, _prefill_reference(case, query, PREFILL_CHUNKS, starts), FP32_REL)


def test_prefill_rejects_an_empty_chunk(kernel) -> None:
    case, query, starts = _prefill_case([(0, 4)], num_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(RuntimeError, match="bad argument"):
        _run_prefill(kernel, case, query, [(0, 0)], starts)
