"""Frozen engine configuration, one dataclass per concern, and the kwargs / CLI mapping onto them.

Only user choices live here. Facts discovered at run time (the checkpoint's architecture, the
resolved context length, the number of KV blocks) are returned by whoever discovers them and
passed down explicitly; nothing writes back into a config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from shoal.engine.lora.config import LoRAConfig
from shoal.engine.rank_engine_config import RankEngineConfig, check_vllm_engine

DType = Literal["auto", "float32", "bfloat16", "float16"]
# Tokens per KV block of shoal's engine when --block-size is not given (vLLM's engine picks its
# own: 128 on CPU, 16 on CUDA).
DEFAULT_BLOCK_SIZE = 16
# `--attention-backend` choices, spelled as vLLM spells them (shoal.engine.model.attention.selector).
ATTENTION_BACKENDS = ("CPU_ATTN", "TORCH_SDPA", "TRITON_ATTN")
# `--scheduling-policy` choices, vLLM's (shoal.engine.request_queue).
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


# The offline `LLM`'s step budget, as vLLM's offline default on CPU: with every request queued
# at once, fewer and larger prefill steps finish the prompts sooner and hold up fewer decodes
# (a served engine keeps the smaller default, which bounds the step a new arrival adds).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096


def _help(text: str) -> dict[str, str]:
    return {"help": text}


# vLLM's `--runner` and `--convert` choices that shoal has (its models are causal LMs).
Runner = Literal["auto", "generate", "pooling"]
Convert = Literal["auto", "none", "embed"]
PoolingType = Literal["LAST", "MEAN"]


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine (`--runner pooling`) turns a prompt's final hidden states into one
    vector: vLLM's `--pooler-config` fields that shoal has.

    Attributes:
        pooling_type: LAST (the last prompt token's state, vLLM's default for `embed`) or MEAN
            (the mean over every prompt token).
        use_activation: L2-normalise the pooled vector (vLLM's embedding activation; its older
            name `normalize` is read too).
    """

    pooling_type: PoolingType = "LAST"
    use_activation: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in get_args(PoolingType):
            raise ValueError(
                f"--pooler-config pooling_type {self.pooling_type!r} is not supported; use "
                f"{' or '.join(get_args(PoolingType))}"
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any] | PoolerConfig) -> PoolerConfig:
        """`--pooler-config`'s JSON (or its dict).

        Raises:
            ValueError: not a JSON object, a field shoal does not have, or a bad value.
        """
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--pooler-config is not JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("--pooler-config must be a JSON object")
        fields = dict(value)
        if "normalize" in fields:  # vLLM's older name
            fields.setdefault("use_activation", fields.pop("normalize"))
        unknown = sorted(set(fields) - {"pooling_type", "use_activation"})
        if unknown:
            raise ValueError(
                f"--pooler-config field(s) {', '.join(unknown)} are not supported; shoal has "
                "pooling_type (LAST or MEAN) and use_activation (normalize)"
            )
        if not isinstance(fields.get("use_activation", True), bool):
            raise ValueError("--pooler-config use_activation must be true or false")
        if isinstance(fields.get("pooling_type"), str):
            fields["pooling_type"] = fields["pooling_type"].upper()
        return cls(**fields)


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

    revision: str | None = field(
        default=None,
        metadata=_help(
            "the branch, tag or commit of a model given as a Hugging Face Hub id; default: main"
        ),
    )
    download_dir: str | None = field(
        default=None,
        metadata=_help(
            "where a model given as a Hub id is downloaded to (and found again); default: the "
            "Hugging Face cache ($HF_HOME/hub)"
        ),
    )
    runner: Runner = field(
        default="auto",
        metadata={
            **_help(
                "generate: sample tokens; pooling: return each prompt's pooled final hidden "
                "state (/v1/embeddings); auto: pooling with --convert embed, else generate"
            ),
            "choices": get_args(Runner),
        },
    )
    convert: Convert = field(
        default="auto",
        metadata={
            **_help(
                "embed: serve the causal LM as an embedding model (implies --runner pooling); "
                "auto: embed under --runner pooling, else none"
            ),
            "choices": get_args(Convert),
        },
    )
    pooler_config: PoolerConfig | None = field(
        default=None,
        metadata=_help(
            'pooling engines: JSON such as \'{"pooling_type": "MEAN", "use_activation": true}\' '
            "(pooling_type LAST or MEAN; use_activation, or normalize: L2-normalise); default: "
            "LAST, normalised"
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
        self._check_runner()
        if self.pooler_config is not None:
            object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
            if not self.is_pooling:
                raise ValueError("--pooler-config applies to --runner pooling only")

    def _check_runner(self) -> None:
        if self.runner not in get_args(Runner):
            raise ValueError(f"unknown runner {self.runner!r}; use one of {get_args(Runner)}")
        if self.convert not in get_args(Convert):
            raise ValueError(f"unknown convert {self.convert!r}; use one of {get_args(Convert)}")
        if self.runner == "generate" and self.convert == "embed":
            raise ValueError("--convert embed makes an embedding model: use --runner pooling")
        if self.runner == "pooling" and self.convert == "none":
            raise ValueError(
                "--runner pooling with --convert none: shoal's models are causal LMs with no "
                "pooler of their own; use --convert embed (or auto)"
            )

    @property
    def is_pooling(self) -> bool:
        """Whether the engine pools (embeddings) instead of generating."""
        return self.runner == "pooling" or self.convert == "embed"

    @property
    def pooler(self) -> PoolerConfig:
        """The pooling engine's pooler (vLLM's defaults for `embed` where not configured)."""
        assert isinstance(self.pooler_config, PoolerConfig | None)
        return self.pooler_config or PoolerConfig()


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry, memory budget and prefix caching."""

    block_size: int | None = field(
        default=None,
        metadata=_help(
            f"tokens per KV block; default: {DEFAULT_BLOCK_SIZE} for shoal's engine, the "
            "platform's for vLLM's (128 on CPU, 16 on CUDA)"
        ),
    )
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

    @property
    def kv_block_size(self) -> int:
        """Tokens per block in shoal's engine: the given size, else `DEFAULT_BLOCK_SIZE`."""
        return DEFAULT_BLOCK_SIZE if self.block_size is None else self.block_size

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
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
    scheduling_policy: SchedulingPolicy = field(
        default="fcfs",
        metadata={
            **_help(
                "fcfs: requests run in arrival order; priority: by their `priority` (lower "
                "first, then arrival), the least urgent running request preempted first when "
                "KV blocks run out (vLLM's policies)"
            ),
            "choices": SCHEDULING_POLICIES,
        },
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
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling_policy {self.scheduling_policy!r}; use fcfs or priority"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Data / expert parallelism across engine ranks, tensor parallelism inside each."""

    data_parallel_size: int = field(
        default=1, metadata={**_help("number of engine ranks"), "aliases": ("-dp",)}
    )
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
    "rank_engine": RankEngineConfig,
    "lora": LoRAConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine core is built from."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rank_engine: RankEngineConfig = field(default_factory=RankEngineConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.rank_engine.engine == "vllm":
            check_vllm_engine(self)

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
            elif f.metadata.get("parse") == "json":
                parser.add_argument(*flags, type=_json_object, default={}, help=help_text)
            else:
                parser.add_argument(
                    *flags,
                    type=_cli_type(f.type),
                    default=default,
                    choices=f.metadata.get("choices"),
                    help=help_text,
                )


def engine_kwargs_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """Collects the engine fields parsed by `add_engine_cli_args`, model excluded."""
    names = {f.name for c in _SECTIONS.values() for f in dataclasses.fields(c)} - {"model"}
    return {k: v for k, v in vars(args).items() if k in names}


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (argparse reports the ValueError as a bad value)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _cli_type(annotation: Any) -> Any:
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str
