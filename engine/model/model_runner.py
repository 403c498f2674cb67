"""`ModelRunner`: owns the model, the KV block pool and the sampler, and runs one engine step.

Each step flattens the scheduled tokens of all requests (decodes first, longest context first,
then prefill chunks) into one batch, runs a single forward over it, and samples only for the
requests whose chunk reaches their last token. It reads requests but never changes them; the
scheduler owns all state changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.profiler import record_function

from shoal.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from shoal.engine.kernels.quant_matmul import QuantizedWeight, load_quant_kernel
from shoal.engine.model.attention import (
    AttentionBatch,
    AttentionMetadata,
    select_attention_backend,
)
from shoal.engine.model.layers import can_pack_weights
from shoal.engine.model.registry import LlamaForCausalLM, get_model_class
from shoal.engine.model.sampler import Sampler
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.expert_parallel import ExpertParallel
from shoal.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
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
    ):
        self.arch = arch
        self.expert_parallel = expert_parallel
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.device = resolve_device(model_config.device if device is None else device)
        self.dtype = resolve_dtype(model_config.dtype, arch, self.device)
        self.block_size = cache_config.block_size
        self.model: LlamaForCausalLM | None = None
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.sampler = Sampler()
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-grammar")
        # Chosen once: the layers call it and never look at the device themselves.
        self.attention_backend = select_attention_backend(
            model_config.attention_backend,
            device=self.device,
            dtype=self.dtype,
            num_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
        )
        # Persistent host buffers: a step writes its inputs here instead of allocating.
        self._input_ids = np.zeros(scheduler_config.max_num_batched_tokens, dtype=np.int64)

    def load_model(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        blocks: Iterable[tuple[str, QuantizedWeight]] | None = None,
    ) -> None:
        """Builds the model for `arch` and loads HF-named tensors into it.

        Args:
            weights: (HF name, tensor) pairs.
            blocks: a GGUF checkpoint's quantized projections; on CPU in float32, steps of
                few rows compute from them (`shoal.engine.kernels.quant_matmul`), when the
                kernel can be built.

        Raises:
            ModelLoadError: unsupported architecture, unknown / missing tensor, shape mismatch.
        """
        model_cls = get_model_class(self.arch.architecture)
        extra = {} if self.expert_parallel is None else {"expert_parallel": self.expert_parallel}
        model = model_cls(
            self.arch,
            max_position=self.max_model_len,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            **extra,
        )
        model.load_weights(weights)
        if can_pack_weights(self.device, self.dtype):
            model.pack_weights()
        if blocks is not None and self.device.type == "cpu" and self.dtype == torch.float32:
            kernel = load_quant_kernel()
            if kernel is not None:
                model.load_blocks(blocks, kernel)
        self.model = model.eval()
        if self.kv_cache is not None:
            self._bind_kv_cache()

    def bytes_per_block(self) -> int:
        """KV bytes of one block across all layers."""
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.arch.kv_bytes_per_token(dtype_bytes)

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
        """Allocates the block pool: one zeroed tensor [layers, 2, KVH, blocks, block_size, D].

        Zeroed, not empty: padded decode rows read unused blocks, and 0 * NaN would leak.
        """
        assert num_blocks >= 1, "need at least one KV block"
        arch = self.arch
        shape = (
            arch.num_hidden_layers,
            2,
            arch.num_key_value_heads,
            num_blocks,
            self.block_size,
            arch.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks
        if self.model is not None:
            self._bind_kv_cache()

    def _bind_kv_cache(self) -> None:
        assert self.model is not None and self.kv_cache is not None
        self.model.bind_kv_cache(list(self.kv_cache.unbind(0)))

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: KV for every scheduled token, a token for every request that samples.

        Args:
            scheduler_output: the step's requests; their `num_computed_tokens` not yet advanced.

        Returns:
            The sampled token (and logprobs, where asked) per sampling request id.
        """
        assert self.model is not None, "load_model first"
        assert self.kv_cache is not None, "initialize_kv_cache first"
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        batch = _order_batch(scheduler_output.scheduled)
        with record_function("shoal::prepare_inputs"):
            input_ids, positions, meta, sample_rows = self._prepare_inputs(batch)
        samplers = [s.request for s in batch if s.samples]
        # Structured outputs: the grammars' masks are computed (without the GIL) while the
        # forward pass runs; nothing changes a grammar's state before the sampler reads it.
        grammars = [g for r in samplers if (g := r.grammar) is not None]
        bitmask = self._grammar_pool.submit(fill_bitmasks, grammars) if grammars else None
        hidden = self.model(input_ids, positions, meta)
        output = ModelRunnerOutput()
        if not sample_rows:
            return output
        with record_function("shoal::sample"):
            rows = torch.tensor(sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
            if bitmask is None:
                sampled = self.sampler(logits, samplers)
            else:
                sampled = self.sampler(logits, samplers, grammar_bitmask=bitmask.result())
        for request, token, logprobs in zip(
            samplers, sampled.token_ids, sampled.logprobs, strict=True
        ):
            output.sampled_token_ids[request.request_id] = token
            if logprobs is not None:
                output.logprobs[request.request_id] = logprobs
        return output

    def _prepare_inputs(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        starts = np.fromiter((s.start for s in batch), dtype=np.int64, count=len(batch))
        num_new = np.fromiter((s.num_new_tokens for s in batch), dtype=np.int64, count=len(batch))
        num_tokens = int(num_new.sum())
        assert int((starts + num_new).max()) <= self.max_model_len, "a request passed max_model_len"
        if num_tokens > len(self._input_ids):
            self._input_ids = np.zeros(num_tokens, dtype=np.int64)
        num_decodes = 0
        decode_ids: list[int] = []
        for s in batch:
            if s.num_new_tokens != 1:
                break
            decode_ids.append(s.request.all_token_ids[s.start])
            num_decodes += 1
        ids = self._input_ids
        ids[:num_decodes] = decode_ids
        offset = num_decodes
        for s in batch[num_decodes:]:
            ids[offset : offset + s.num_new_tokens] = s.request.all_token_ids[
                s.start : s.start + s.num_new_tokens
            ]
            offset += s.num_new_tokens
        attn_batch = AttentionBatch(
            starts=starts,
            num_new_tokens=num_new,
            block_table=_block_table(batch, (starts + num_new - 1) // self.block_size + 1),
            num_decodes=num_decodes,
            block_size=self.block_size,
        )
        meta = self.attention_backend.build_metadata(attn_batch, self.device)
        ends = np.cumsum(num_new)
        sample_rows = [int(ends[i]) - 1 for i, s in enumerate(batch) if s.samples]
        input_ids = torch.from_numpy(ids[:num_tokens]).to(self.device, non_blocking=True)
        positions = torch.from_numpy(attn_batch.positions).to(self.device)
        return input_ids, positions, meta, sample_rows


def _order_batch(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes (one new token) first, longest context first, then the prefill chunks."""
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    decodes.sort(key=lambda s: s.start, reverse=True)
    return decodes + [s for s in scheduled if s.num_new_tokens != 1]


def _block_table(batch: list[ScheduledRequest], num_blocks: np.ndarray) -> np.ndarray:
    """[R, max blocks] block ids covering each request's context (zero-padded)."""
    table = np.zeros((len(batch), int(num_blocks.max())), dtype=np.int64)
    for i, s in enumerate(batch):
        n = int(num_blocks[i])
        assert len(s.block_ids) >= n, f"{s.request.request_id}: blocks do not cover the chunk"
        table[i, :n] = s.block_ids[:n]
    return table
