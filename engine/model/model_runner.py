"""`ModelRunner`: owns the model, the KV block pool and the sampler, and runs one engine step.

Each step flattens the scheduled tokens of all requests (decodes first, longest context first,
then prefill chunks) into one batch (`StepInput`), runs a single forward over it, and samples
only for the requests whose chunk reaches their last token. It reads requests but never changes
them; the scheduler owns all state changes. Under tensor parallelism every worker of the rank
runs the same `StepInput` over its shard; only the driver's runner samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from shoal.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from shoal.engine.kernels.quant_matmul import QuantizedWeight, load_quant_kernel
from shoal.engine.loader import LazyTensor
from shoal.engine.lora.adapter import AdapterError
from shoal.engine.lora.config import LoRAConfig
from shoal.engine.model.attention import (
    AttentionBatch,
    AttentionMetadata,
    select_attention_backend,
)
from shoal.engine.model.layers import can_pack_weights
from shoal.engine.model.lora_model import LoRAModel
from shoal.engine.model.pooler import Pooler
from shoal.engine.model.registry import LlamaForCausalLM, get_model_class
from shoal.engine.model.sampler import Sampler
from shoal.engine.model.step_input import PoolChunk, StepInput, plan_step
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.expert_parallel import ExpertParallel
from shoal.engine.parallel.tensor_parallel import SINGLE, TensorParallel
from shoal.engine.request import Request
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.structured_output import fill_bitmasks

_CPU_KV_CACHE_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: torch.device | str) -> torch.device:
    """ "auto" -> cuda when available, else cpu.

    Raises:
        ValueError: a CUDA device was asked for and this torch cannot reach one.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r} was asked for, but torch {torch.__version__} sees no CUDA "
            "device (use device='cpu' or 'auto')"
        )
    return resolved


def resolve_dtype(dtype: str, arch: ModelArch, device: torch.device) -> torch.dtype:
    """The compute dtype: "auto" is the checkpoint's, except float16 becomes float32 on CPU.

    Raises:
        ValueError: for float16 on CPU, or a dtype name this engine does not run.
    """
    name = arch.torch_dtype.removeprefix("torch.") if dtype == "auto" else dtype
    if dtype == "auto" and name == "float16" and device.type == "cpu":
        name = "float32"
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(_DTYPES)}")
    if name == "float16" and device.type == "cpu":
        raise ValueError("float16 runs only on CUDA; use float32 or bfloat16 on CPU")
    return _DTYPES[name]


class ModelRunner:
    """Runs the model over scheduled steps on one device.

    Args:
        model_config: dtype and attention backend choice.
        cache_config: block size and the KV memory budget.
        scheduler_config: per-step token limit (sizes the persistent input buffers).
        arch: the checkpoint's architecture facts.
        max_model_len: longest sequence served (sizes the rotary table).
        device: "cpu", "cuda", "cuda:N" or "auto"; default: `model_config.device`.
        expert_parallel: this rank's share of an MoE model's experts and their exchange.
        tensor_parallel: this worker's place in its rank's TP group; default: the whole model.
        lora_config: LoRA limits; LoRA is served when `enable_lora`.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        arch: ModelArch,
        *,
        max_model_len: int,
        device: torch.device | str | None = None,
        expert_parallel: ExpertParallel | None = None,
        tensor_parallel: TensorParallel | None = None,
        lora_config: LoRAConfig | None = None,
    ):
        self.arch = arch
        self.lora_config = lora_config if lora_config and lora_config.enable_lora else None
        self.lora: LoRAModel | None = None
        self.expert_parallel = expert_parallel
        self.tp = tensor_parallel or SINGLE
        self.num_kv_heads = self.tp.kv_head_shard(arch.num_kv_cache_heads).size
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.device = resolve_device(model_config.device if device is None else device)
        self.dtype = resolve_dtype(model_config.dtype, arch, self.device)
        self.block_size = cache_config.kv_block_size
        self.model: LlamaForCausalLM | None = None
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.sampler = Sampler(model_config.seed)
        # A pooling engine (`--runner pooling`) pools its requests' states instead.
        self.pooler = Pooler(model_config.pooler) if model_config.is_pooling else None
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-grammar")
        # Chosen once: the layers call it and never look at the device themselves.
        self.attention_backend = select_attention_backend(
            model_config.attention_backend,
            device=self.device,
            dtype=self.dtype,
            num_heads=arch.num_attention_heads // self.tp.size,
            num_kv_heads=self.num_kv_heads,
            head_dim=arch.kv_cache_head_dim,
        )
        # Persistent host buffers: a step writes its inputs here instead of allocating.
        self._input_ids = np.zeros(scheduler_config.max_num_batched_tokens, dtype=np.int64)

    def load_model(
        self,
        weights: Iterable[tuple[str, torch.Tensor | LazyTensor]],
        blocks: Iterable[tuple[str, QuantizedWeight]] | None = None,
    ) -> None:
        """Builds the model for `arch` and loads HF-named tensors into it.

        Args:
            weights: (HF name, tensor or unread tensor) pairs.
            blocks: a GGUF checkpoint's quantized projections; on CPU in float32, steps of
                few rows compute from them (`shoal.engine.kernels.quant_matmul`), when the
                kernel can be built.

        Raises:
            ModelLoadError: unsupported architecture, unknown / missing tensor, shape mismatch.
        """
        model_cls = get_model_class(self.arch.architecture)
        extra: dict[str, Any] = {}
        if self.expert_parallel is not None:
            extra["expert_parallel"] = self.expert_parallel
        if self.tp.size > 1:
            extra["tensor_parallel"] = self.tp
        model = model_cls(
            self.arch,
            max_position=self.max_model_len,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            **extra,
        )
        model.load_weights(weights)  # each projection narrowed to this worker's shard
        if can_pack_weights(self.device, self.dtype):
            model.pack_weights()
        if blocks is not None and self.device.type == "cpu" and self.dtype == torch.float32:
            kernel = load_quant_kernel()
            if kernel is not None:
                model.load_blocks(blocks, kernel)
        self.model = model.eval()
        if self.lora_config is not None:
            targets = model.lora_targets()
            self.lora = LoRAModel(targets, self.lora_config, dtype=self.dtype, device=self.device)
        if self.kv_cache is not None:
            self._bind_kv_cache()

    def check_lora_adapter(self, path: str) -> str | None:
        """Why the adapter folder at `path` cannot serve on this model, or None if it can."""
        if self.lora is None:
            return "LoRA is not enabled on this engine (start it with --enable-lora)"
        try:
            self.lora.check(path)
        except AdapterError as e:
            return str(e)
        return None

    def lora_disk_reads(self) -> int:
        """LoRA adapters this worker read from their folders (0 without LoRA)."""
        return 0 if self.lora is None else self.lora.num_disk_reads

    def bytes_per_block(self) -> int:
        """KV bytes of one block across all layers (this worker's KV heads only)."""
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        arch = self.arch
        per_layer = arch.num_kv_cache_parts * self.num_kv_heads * arch.kv_cache_head_dim
        return self.block_size * arch.num_hidden_layers * per_layer * dtype_bytes

    def parameter_bytes(self) -> int:
        """Bytes of the weights this worker holds (packed copies counted as their dense size)."""
        assert self.model is not None, "load_model first"
        held = {id(t): t for t in self.model.parameters()}
        return sum(t.numel() * t.element_size() for t in held.values()) + _packed_bytes(self.model)

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the budget: the override, else the byte budget / bytes per block.

        Raises:
            ValueError: when not even one block fits.
        """
        if self.cache_config.num_gpu_blocks_override is not None:
            return self.cache_config.num_gpu_blocks_override
        budget = self._kv_budget_bytes()
        num_blocks = budget // self.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {self.bytes_per_block()} "
                "bytes; raise kv_cache_memory_bytes / gpu_memory_utilization or lower block_size"
            )
        return num_blocks

    def _kv_budget_bytes(self) -> int:
        if self.cache_config.kv_cache_memory_bytes is not None:
            return self.cache_config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return _CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * self.cache_config.gpu_memory_utilization) - (total - free)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the block pool: one zeroed tensor [layers, 2, KVH, blocks, block_size, D]
        ([layers, 1, 1, ...] for latent attention, which caches the latent only).

        Zeroed, not empty: padded decode rows read unused blocks, and 0 * NaN would leak.
        """
        assert num_blocks >= 1, "need at least one KV block"
        arch = self.arch
        shape = (
            arch.num_hidden_layers,
            arch.num_kv_cache_parts,
            self.num_kv_heads,
            num_blocks,
            self.block_size,
            arch.kv_cache_head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks
        if self.model is not None:
            self._bind_kv_cache()

    def _bind_kv_cache(self) -> None:
        assert self.model is not None and self.kv_cache is not None
        self.model.bind_kv_cache(list(self.kv_cache.unbind(0)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: KV for every scheduled token, a token for every request that samples.

        Args:
            scheduler_output: the step's requests; their `num_computed_tokens` not yet advanced.

        Returns:
            The sampled token (and logprobs, where asked) per sampling request id.
        """
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        step, samplers, poolers = plan_step(scheduler_output, self.block_size)
        return self.execute_step(step, samplers, poolers)

    @torch.inference_mode()
    def execute_step(
        self,
        step: StepInput,
        samplers: Sequence[Request] | None,
        poolers: Sequence[PoolChunk] = (),
    ) -> ModelRunnerOutput:
        """Runs one planned step (`plan_step`).

        Args:
            step: the batch; not empty.
            samplers: the requests of `step.sample_rows`, in order; None on a TP worker that is
                not the driver: it joins the forward's and the logits' collectives, samples
                nothing and returns an empty output.
            poolers: the pooling requests' chunks (the driver's; a pooling engine only).
        """
        assert self.model is not None, "load_model first"
        assert self.kv_cache is not None, "initialize_kv_cache first"
        with record_function("shoal::prepare_inputs"):
            input_ids, positions, meta = self._prepare_inputs(step)
        # Structured outputs: the grammars' masks are computed (without the GIL) while the
        # forward pass runs; nothing changes a grammar's state before the sampler reads it.
        grammars = [g for r in samplers or () if (g := r.grammar) is not None]
        bitmask = self._grammar_pool.submit(fill_bitmasks, grammars) if grammars else None
        output = ModelRunnerOutput()
        if self.lora is not None:
            output.lora_errors = self.lora.prepare(step.lora_requests, step.num_new_tokens)
            output.lora_load_s = self.lora.step_load_s
        hidden = self.model(input_ids, positions, meta)
        if poolers:
            assert self.pooler is not None, "pooling requests reached a generating engine"
            with record_function("shoal::pool"):
                output.pooled = self.pooler.pool(poolers, hidden)
        if not step.sample_rows:
            return output
        with record_function("shoal::sample"):
            rows = torch.tensor(step.sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
            if samplers is None:
                return output
            if bitmask is None:
                sampled = self.sampler(logits, list(samplers))
            else:
                sampled = self.sampler(logits, list(samplers), grammar_bitmask=bitmask.result())
        for request, token, logprobs in zip(
            samplers, sampled.token_ids, sampled.logprobs, strict=True
        ):
            output.sampled_token_ids[request.request_id] = token
            if logprobs is not None:
                output.logprobs[request.request_id] = logprobs
        return output

    def _prepare_inputs(
        self, step: StepInput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        starts = np.asarray(step.starts, dtype=np.int64)
        num_new = np.asarray(step.num_new_tokens, dtype=np.int64)
        num_tokens = step.num_tokens
        assert int((starts + num_new).max()) <= self.max_model_len, "a request passed max_model_len"
        if num_tokens > len(self._input_ids):
            self._input_ids = np.zeros(num_tokens, dtype=np.int64)
        ids = self._input_ids
        ids[:num_tokens] = step.token_ids
        attn_batch = AttentionBatch(
            starts=starts,
            num_new_tokens=num_new,
            block_table=_block_table(step.block_ids),
            num_decodes=step.num_decodes,
            block_size=self.block_size,
        )
        meta = self.attention_backend.build_metadata(attn_batch, self.device)
        input_ids = torch.from_numpy(ids[:num_tokens]).to(self.device, non_blocking=True)
        positions = torch.from_numpy(attn_batch.positions).to(self.device)
        return input_ids, positions, meta


def _block_table(block_ids: list[list[int]]) -> np.ndarray:
    """[R, max blocks] block ids covering each request's context (zero-padded)."""
    table = np.zeros((len(block_ids), max(len(b) for b in block_ids)), dtype=np.int64)
    for i, blocks in enumerate(block_ids):
        table[i, : len(blocks)] = blocks
    # Blocks a sliding window freed are -1 in the scheduler's tables; attention never reads
    # them, and 0 keeps any masked load in bounds.
    return np.maximum(table, 0, out=table)


def _packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the oneDNN-packed weights, which replaced their parameters (their dense size)."""
    total = 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            total += packed.size().numel() * packed.element_size()
        elif isinstance(packed, list):
            total += sum(t.size().numel() * t.element_size() for pair in packed for t in pair)
    return total
