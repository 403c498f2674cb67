"""Frozen engine configuration, one dataclass per concern, and the kwargs / CLI mapping onto them.

Only user choices live here. Facts discovered at run time (the checkpoint's architecture, the
resolved context length, the number of KV blocks) are returned by whoever discovers them and
passed down explicitly; nothing writes back into a config.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
# `--attention-backend` choices, spelled as vLLM spells them (shoal.engine.model.attention.selector).
ATTENTION_BACKENDS = ("CPU_ATTN", "TORCH_SDPA", "TRITON_ATTN")


# The offline `LLM`'s step budget, as vLLM's offline default on CPU: with every request queued
# at once, fewer and larger prefill steps finish the prompts sooner and hold up fewer decodes
# (a served engine keeps the smaller default, which bounds the step a new arrival adds).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to serve and how to hold its weights."""

    model: str = field(metadata=_help("local path: a Hugging Face directory or a .gguf file"))
    dtype: DType = field(
        default="auto",
        metadata=_help("weight and activation dtype; auto: the checkpoint's (float32 for GGUF)"),
    )
    max_model_len: int | None = field(
        default=None, metadata=_help("context length limit; default: the model's")
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        default="auto", metadata=_help("auto: cuda when available, else cpu")
    )
    tokenizer: str | None = field(
        default=None, metadata=_help("tokenizer.json or directory; default: from the model")
    )
    cpu_threads: int | None = field(
        default=None, metadata=_help("torch intra-op threads on CPU; default: torch's own")
    )
    # vLLM's default; each logprob asked for costs a top-k over the vocabulary.
    max_logprobs: int = field(
        default=20, metadata=_help("the most logprobs a request may ask for per token")
    )
    seed: int | None = field(
        default=None,
        metadata=_help(
            "seeds the sampling of requests that carry no seed of their own, as vLLM's --seed: "
            "the same requests in the same order get the same tokens; default: unseeded"
        ),
    )
    attention_backend: str | None = field(
        default=None,
        metadata=_help(
            f"paged attention kernels, one of {', '.join(ATTENTION_BACKENDS)}; default: "
            "CPU_ATTN on CPU, TRITON_ATTN on CUDA (TRITON_ATTN on CPU runs Triton's "
            "interpreter: slow, for stepping through the GPU kernel)"
        ),
    )

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must not be negative, got {self.max_logprobs}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}; use one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry, memory budget and prefix caching."""

    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("reuse KV blocks of identical prompt prefixes")
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_help(
            "KV cache budget in bytes; default: 1 GiB on CPU, a share of free GPU memory"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_help("fraction of GPU memory the engine may use")
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=_help("exact number of KV blocks, overriding the budget")
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per engine step."""

    max_num_seqs: int = field(default=256, metadata=_help("max requests in one step"))
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=_help(
            "max tokens (prefill + decode) in one step (offline `LLM`: "
            f"{OFFLINE_MAX_NUM_BATCHED_TOKENS} unless given)"
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_help("split long prompts across steps")
    )
    step_timeout_s: float = field(
        default=300.0,
        metadata=_help(
            "a step that runs longer (a hung kernel or collective) ends the engine, which its "
            "host restarts; 0: no limit"
        ),
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.step_timeout_s < 0:
            raise ValueError("step_timeout_s must be positive, or 0 for no limit")


@dataclass(frozen=True)
class ParallelConfig:
    """Data / expert parallelism across engine ranks, tensor parallelism inside each."""

    data_parallel_size: int = field(default=1, metadata=_help("number of engine ranks"))
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            **_help("devices (CPU: processes) each rank splits the model over, one worker each"),
            "aliases": ("-tp",),
        },
    )
    data_parallel_rank: int = field(default=0, metadata=_help("this engine's rank"))
    enable_expert_parallel: bool = field(
        default=False,
        metadata=_help(
            "shard a mixture-of-experts model's experts across the data-parallel ranks, which "
            "then step in lockstep (DP waves)"
        ),
    )
    collective_timeout_s: float = field(
        default=30.0,
        metadata=_help(
            "expert parallelism: a collective that waits longer for a peer ends the wave, and "
            "the ranks restart; tensor parallelism: a collective of a rank's workers that waits "
            "longer ends the rank, which restarts"
        ),
    )

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}"
            )
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {self.data_parallel_rank} is outside "
                f"[0, {self.data_parallel_size})"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if not self.collective_timeout_s > 0:
            raise ValueError("collective_timeout_s must be positive")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine core is built from."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Builds a config from flat keyword arguments named like the dataclass fields.

        Raises:
            TypeError: for a keyword that no section has.
        """
        per_section: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        per_section["model"]["model"] = model
        owner = {f.name: name for name, c in _SECTIONS.items() for f in dataclasses.fields(c)}
        for key, value in kwargs.items():
            if key not in owner or key == "model":
                raise TypeError(f"unknown engine argument {key!r}")
            per_section[owner[key]][key] = value
        sections = {name: c(**per_section[name]) for name, c in _SECTIONS.items()}
        return cls(**sections)

    def with_rank(
        self, data_parallel_rank: int, data_parallel_size: int | None = None
    ) -> EngineConfig:
        """The same config for another rank (and optionally another DP size)."""
        size = (
            self.parallel.data_parallel_size if data_parallel_size is None else data_parallel_size
        )
        parallel = dataclasses.replace(
            self.parallel, data_parallel_rank=data_parallel_rank, data_parallel_size=size
        )
        return dataclasses.replace(self, parallel=parallel)


def add_engine_cli_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Adds one `--flag-name` per config field (the names vLLM users know), model excluded."""
    for section in _SECTIONS.values():
        for f in dataclasses.fields(section):
            if f.name == "model" or f.name in skip:
                continue
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_text = f.metadata.get("help", "")
            default = f.default
            if isinstance(default, bool):
                parser.add_argument(
                    *flags, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
            else:
                parser.add_argument(*flags, type=_cli_type(f.type), default=default, help=help_text)


def engine_kwargs_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """Collects the engine fields parsed by `add_engine_cli_args`, model excluded."""
    names = {f.name for c in _SECTIONS.values() for f in dataclasses.fields(c)} - {"model"}
    return {k: v for k, v in vars(args).items() if k in names}


def _cli_type(annotation: Any) -> Any:
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str
