"""Builds, caches and calls the C paged attention kernels (engine/kernels/csrc/paged_attention.c): decode
(one query per sequence) and prefill (every chunk of a step in one call, causal).

Compiled on first use with the system C compiler into a cache keyed by source, flags, compiler
and CPU, then loaded with ctypes. Knows tensors, pointers and strides; not requests, metadata or
models. When the kernel cannot be had it says so once and callers keep the torch path. The
build and cache (`build_kernel`, `load_cpu_kernel`) serve every kernel of engine/kernels/csrc.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

K = TypeVar("K")

SOURCE_PATH = Path(__file__).parent / "csrc" / "paged_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
DISABLE_ENV = "SHOAL_DISABLE_CPU_KERNEL"
CACHE_ENV = "SHOAL_KERNEL_CACHE"
# SHOAL_CPU_ISA narrows every kernel build below what -march=native allows, so one machine can
# run the code a machine with fewer instructions would: "avx2" leaves out AVX-512, "avx" AVX2
# and FMA as well. Unset or "native": all this CPU has.
ISA_ENV = "SHOAL_CPU_ISA"
ISA_CFLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx2": ("-mno-avx512f",),
    "avx": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
}
# The C side's buffer bounds (MAX_HEAD_DIM, MAX_GROUP) and dtype codes.
MAX_HEAD_DIM = 576
MAX_GROUP = 64
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "bad argument", -2: "out of memory"}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = (
    [_ptr, _i64, _i64]  # out, its seq / head strides
    + [_ptr, _i64, _i64]  # query, its seq / head strides
    + [_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int]  # key, value, head/block/token strides, dtype
    + [_ptr, _i64, _ptr]  # block tables, row stride, context lens
    + [_i64] * 7  # seqs, heads, kv heads, head_dim, v_head_dim, block_size, partition_blocks
    + [_i64, _ptr]  # window, sinks
    + [ctypes.c_float, ctypes.c_int]  # scale, threads
)
_PREFILL_ARGTYPES: list[Any] = (
    [_ptr, _i64, _i64]  # out, its token / head strides
    + [_ptr, _i64, _i64]  # query, its token / head strides
    + [_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int]  # key, value, head/block/token strides, dtype
    + [_ptr, _i64, _ptr, _ptr, _ptr]  # block tables, row stride, q starts, q lens, start pos
    + [_i64] * 6  # seqs, heads, kv heads, head_dim, v_head_dim, block_size
    + [_i64, _ptr]  # window, sinks
    + [ctypes.c_float, ctypes.c_int]  # scale, threads
)


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled or loaded; the torch path still works."""


class PagedDecodeKernel:
    """The loaded kernel: decode attention straight from one layer's paged K/V pool.

    Args:
        library_path: the compiled shared object.

    Raises:
        OSError: the shared object cannot be loaded (e.g. an OpenMP symbol torch's runtime lacks).
    """

    def __init__(self, library_path: Path):
        self.library_path = library_path
        lib = ctypes.CDLL(str(library_path))
        self._fn = lib.shoal_paged_decode_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int
        self._prefill_fn = lib.shoal_paged_prefill_attention
        self._prefill_fn.argtypes = _PREFILL_ARGTYPES
        self._prefill_fn.restype = ctypes.c_int

    def decode(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        scale: float,
        partition_blocks: int,
        num_threads: int,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """out[s, h] = softmax(scale * q[s, h] K_s^T) V_s over positions [0, context_lens[s])
        (only the last `sliding_window` of them with a window).

        Query head h reads kv head h // (num_heads // num_kv_heads).

        Args:
            out: fp32 [num_seqs, num_heads, v_head_dim], written; the last dim contiguous.
                A v_head_dim below head_dim reads the values as the first v_head_dim entries
                of `value_cache`'s rows (latent attention: `value_cache` is `key_cache`).
            query: fp32 [num_seqs, num_heads, head_dim]; the last dim contiguous.
            key_cache: one layer's K pool [num_kv_heads, num_blocks, block_size, head_dim],
                fp32 or bf16; the last dim contiguous.
            value_cache: V pool, same shape, dtype and strides as `key_cache`.
            block_tables: int32 [num_seqs, max_blocks]; row s covers context_lens[s].
            context_lens: int32 [num_seqs], each >= 1 (contiguous).
            scale: multiplies the scores (usually head_dim ** -0.5).
            partition_blocks: blocks per work item; longer contexts are split and merged.
            num_threads: OpenMP threads (pass torch.get_num_threads()).
            sliding_window: a query at position i sees keys (i - window, i] only.
            sinks: fp32 [num_heads]: each head's softmax has one more term, exp(sinks[h]),
                with no value.

        Raises:
            RuntimeError: the kernel rejected its arguments or ran out of memory.
        """
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads, _, block_size, _ = key_cache.shape
        v_head_dim = out.shape[2]
        assert out.shape[:2] == query.shape[:2] and v_head_dim <= head_dim, (
            f"out {tuple(out.shape)} does not fit query {tuple(query.shape)}"
        )
        assert out.dtype == query.dtype == torch.float32, "query and out are float32"
        assert key_cache.dtype in _KV_DTYPES, f"unsupported KV dtype {key_cache.dtype}"
        assert value_cache.dtype == key_cache.dtype, "K and V dtypes differ"
        assert value_cache.shape == key_cache.shape, "K and V shapes differ"
        assert value_cache.stride() == key_cache.stride(), "K and V strides differ"
        assert key_cache.shape[3] == head_dim, "query and pool head_dim differ"
        for name, t in (("out", out), ("query", query), ("key_cache", key_cache)):
            assert t.stride(-1) == 1, f"{name}: head_dim must be contiguous"
            assert t.device.type == "cpu", f"{name} is on {t.device}; the kernel runs on CPU"
        assert block_tables.dtype == context_lens.dtype == torch.int32, "tables are int32"
        assert block_tables.stride(-1) == 1 and context_lens.is_contiguous()
        assert block_tables.shape[0] == context_lens.shape[0] == num_seqs, "one row per seq"
        args = (
            *(out.data_ptr(), out.stride(0), out.stride(1)),
            *(query.data_ptr(), query.stride(0), query.stride(1)),
            *(key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride()[:3]),
            _KV_DTYPES[key_cache.dtype],
            *(block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr()),
            *(num_seqs, num_heads, num_kv_heads, head_dim, v_head_dim, block_size),
            partition_blocks,
            *_layer_args(sliding_window, sinks, num_heads),
            *(scale, num_threads),
        )
        # Named in torch profiles, which do not see foreign calls otherwise.
        with torch.profiler.record_function("shoal::paged_decode_attention"):
            rc = self._fn(*args)
        if rc != 0:
            raise RuntimeError(f"paged decode attention kernel failed: {_ERRORS.get(rc, rc)}")

    def prefill(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        start_pos: torch.Tensor,
        *,
        scale: float,
        num_threads: int,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Causal attention for every prefill chunk at once, K/V read from the pool in place.

        Chunk s owns query rows [q_starts[s], q_starts[s] + q_lens[s]) at positions
        [start_pos[s], start_pos[s] + q_lens[s]); row i attends its sequence's positions
        [0, start_pos[s] + i] (with a window, the last `sliding_window` of them), whose K/V (the
        chunk's own included) are already in the pool.

        Args:
            out: fp32 [num_tokens, num_heads, v_head_dim], its chunks' rows written.
            query: fp32 [num_tokens, num_heads, head_dim]; the last dim contiguous.
            key_cache, value_cache: one layer's pools, as for `decode`.
            block_tables: int32 [num_seqs, max_blocks]; row s covers its chunk's last position.
            q_starts, q_lens, start_pos: int32 [num_seqs], contiguous.
            scale: multiplies the scores.
            num_threads: OpenMP threads.
            sliding_window, sinks: as for `decode`.

        Raises:
            RuntimeError: the kernel rejected its arguments or ran out of memory.
        """
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, _, block_size, _ = key_cache.shape
        num_seqs = q_lens.shape[0]
        v_head_dim = out.shape[2]
        assert out.shape[:2] == query.shape[:2] and v_head_dim <= head_dim
        assert out.dtype == query.dtype == torch.float32
        assert key_cache.dtype in _KV_DTYPES and value_cache.dtype == key_cache.dtype
        assert value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride()
        assert key_cache.shape[3] == head_dim, "query and pool head_dim differ"
        for name, t in (("out", out), ("query", query), ("key_cache", key_cache)):
            assert t.stride(-1) == 1, f"{name}: head_dim must be contiguous"
            assert t.device.type == "cpu", f"{name} is on {t.device}; the kernel runs on CPU"
        for t in (block_tables, q_starts, q_lens, start_pos):
            assert t.dtype == torch.int32 and t.shape[0] == num_seqs, "int32, one row per seq"
        assert block_tables.stride(-1) == 1, "block tables: rows contiguous"
        assert q_starts.is_contiguous() and q_lens.is_contiguous() and start_pos.is_contiguous()
        args = (
            *(out.data_ptr(), out.stride(0), out.stride(1)),
            *(query.data_ptr(), query.stride(0), query.stride(1)),
            *(key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride()[:3]),
            _KV_DTYPES[key_cache.dtype],
            *(block_tables.data_ptr(), block_tables.stride(0)),
            *(q_starts.data_ptr(), q_lens.data_ptr(), start_pos.data_ptr()),
            *(num_seqs, num_heads, num_kv_heads, head_dim, v_head_dim, block_size),
            *_layer_args(sliding_window, sinks, num_heads),
            *(scale, num_threads),
        )
        with torch.profiler.record_function("shoal::paged_prefill_attention"):
            rc = self._prefill_fn(*args)
        if rc != 0:
            raise RuntimeError(f"paged prefill attention kernel failed: {_ERRORS.get(rc, rc)}")


def _layer_args(
    sliding_window: int | None, sinks: torch.Tensor | None, num_heads: int
) -> tuple[int, int | None]:
    """(window, sinks pointer) as the kernels take them: 0 and NULL for none."""
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.is_contiguous(), "sinks: contiguous fp32"
        assert sinks.shape == (num_heads,) and sinks.device.type == "cpu", "sinks: one per head"
    assert sliding_window is None or sliding_window >= 1, "a window covers at least one key"
    return sliding_window or 0, sinks.data_ptr() if sinks is not None else None


def is_supported(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles this attention shape and KV dtype."""
    return (
        dtype in _KV_DTYPES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
    )


def load_decode_kernel() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None when disabled by SHOAL_DISABLE_CPU_KERNEL=1 or
    when it cannot be built or loaded (logged once per process)."""
    if os.environ.get(DISABLE_ENV, "") == "1":
        return None
    return _load_once()


@functools.cache
def _load_once() -> PagedDecodeKernel | None:
    return load_cpu_kernel(PagedDecodeKernel, SOURCE_PATH, "paged attention", "the torch path")


def load_cpu_kernel(
    wrap: Callable[[Path], K], source_path: Path, what: str, instead: str
) -> K | None:
    """Builds (or finds in the cache) one of engine/kernels/csrc's kernels and wraps the shared object;
    None, with one warning naming `what` fails and what serves `instead`, when it cannot be
    built or loaded. Callers cache the answer for the process."""
    try:
        return wrap(build_kernel(source_path=source_path))
    except (KernelBuildError, OSError) as e:
        logger.warning("%s CPU kernel unavailable, using %s: %s", what, instead, e)
        return None


def kernel_cache_dir() -> Path:
    """Where built kernels live: $SHOAL_KERNEL_CACHE, else ~/.cache/shoal/kernels."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "shoal" / "kernels"


def build_kernel(
    cache_dir: Path | None = None,
    *,
    extra_cflags: tuple[str, ...] = (),
    source_path: Path = SOURCE_PATH,
) -> Path:
    """The path of the kernel built for this source, compiler, flags and CPU; compiles it if
    the cache lacks it. Concurrent builders each compile to a temp file and rename, so a
    reader never sees a partial file.

    Args:
        cache_dir: where to look and build; default `kernel_cache_dir()`.
        extra_cflags: appended to CFLAGS and $SHOAL_CPU_ISA's flags (e.g. "-DSHOAL_PORTABLE"
            for the shuffle-free path).
        source_path: the C file (default the paged attention kernels; every CPU kernel of
            `engine/kernels/csrc` is built and cached this way).

    Raises:
        KernelBuildError: no C compiler, or the compile failed.
    """
    compiler = _find_compiler()
    # The headers beside the source are part of what it compiles to.
    source = b"".join(
        p.read_bytes() for p in (source_path, *sorted(source_path.parent.glob("*.h")))
    )
    flags = (*CFLAGS, *isa_cflags(), *extra_cflags)
    key = hashlib.sha256()
    for part in (source, " ".join(flags).encode(), _compiler_identity(compiler), _cpu_identity()):
        key.update(part)
        key.update(b"\0")
    directory = cache_dir or kernel_cache_dir()
    target = directory / f"{source_path.stem}-{key.hexdigest()[:24]}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".build-", suffix=".so")
    except OSError as e:
        raise KernelBuildError(f"cannot write to the kernel cache {directory}: {e}") from e
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(source_path)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelBuildError(f"{' '.join(cmd)} failed: {e}") from e
        if result.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def isa_cflags() -> tuple[str, ...]:
    """The flags $SHOAL_CPU_ISA asks for (see ISA_CFLAGS).

    Raises:
        KernelBuildError: a value ISA_CFLAGS does not name.
    """
    name = os.environ.get(ISA_ENV) or "native"
    if name not in ISA_CFLAGS:
        raise KernelBuildError(f"{ISA_ENV}={name!r}: expected one of {', '.join(ISA_CFLAGS)}")
    return ISA_CFLAGS[name]


def _find_compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise KernelBuildError("no C compiler found (set CC, or install cc / gcc)")


def _compiler_identity(compiler: str) -> bytes:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"cannot run {compiler}: {e}") from e
    return compiler.encode() + b"\n" + result.stdout


def _cpu_identity() -> bytes:
    """The machine and, on Linux, the first CPU's model name and feature flags: -march=native
    code must not be loaded on a CPU that lacks the instructions it was built for."""
    wanted = ("model name", "flags", "Features", "CPU part")
    lines: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in wanted and name not in lines:
                    lines[name] = value.strip()
    except OSError:
        lines["processor"] = platform.processor()
    return "\n".join([platform.machine(), *(f"{k}={v}" for k, v in sorted(lines.items()))]).encode()
