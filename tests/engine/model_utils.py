"""Test factories for the model tests: tiny HF models built in memory, their ModelArch, a runner
loaded from their state_dict, and a scheduler-like driver that prefills then decodes."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from shoal.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from shoal.engine.model.model_runner import ModelRunner
from shoal.engine.model.sampler import Sampler, SamplerOutput
from shoal.engine.model_arch import ModelArch
from shoal.engine.protocol import SamplingParams
from shoal.engine.request import Request
from shoal.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tests.tolerances import decoder_reduction_length, reordering_tolerance

VOCAB = 96
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    # Larger than HF's default 0.02 so logits have clear margins and greedy paths are stable.
    initializer_range=0.2,
    tie_word_embeddings=False,
)

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")
# The reductions behind these models' logits, at their longest context (tests/tolerances.py).
LOGITS_REDUCTION_LENGTH = decoder_reduction_length(
    hidden=_COMMON["hidden_size"],
    intermediate=_COMMON["intermediate_size"],
    head_dim=_COMMON["hidden_size"] // _COMMON["num_attention_heads"],
    num_layers=_COMMON["num_hidden_layers"],
    context=_COMMON["max_position_embeddings"],
)


def make_hf_model(architecture: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny randomly initialised HF model of `architecture`, float32, eval mode."""
    torch.manual_seed(seed)
    kwargs = {**_COMMON, **overrides}
    model: Any
    if architecture == "LlamaForCausalLM":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    elif architecture == "Qwen2ForCausalLM":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    else:
        kwargs.setdefault("num_local_experts", 4)
        kwargs.setdefault("num_experts_per_tok", 2)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kwargs))
    with torch.no_grad():
        # HF starts biases at 0 and norm weights at 1; perturb them so loading them is tested.
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    # No EOS: HF would stop early (or, with min_new_tokens, mask it) where the runner does not.
    model.generation_config.eos_token_id = None
    return model.float().eval()


def arch_from_hf(model: Any) -> ModelArch:
    """ModelArch from an HF config, as the loader would build it."""
    c = model.config
    rope = dict(c.rope_parameters or {})
    theta = float(rope.pop("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return ModelArch(
        architecture=type(model).__name__,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(c.tie_word_embeddings),
        attention_bias=bool(getattr(c, "attention_bias", False)),
        num_local_experts=getattr(c, "num_local_experts", 0),
        num_experts_per_tok=getattr(c, "num_experts_per_tok", 0),
        rope_scaling=scaling,
    )


def make_runner(
    hf_model: Any,
    *,
    block_size: int = 4,
    num_blocks: int = 256,
    dtype: str = "float32",
    max_num_batched_tokens: int = 512,
    weights: dict[str, torch.Tensor] | None = None,
    device: str = "cpu",
    attention_backend: str | None = None,
) -> ModelRunner:
    """A runner with `hf_model`'s weights (or `weights`) loaded and `num_blocks` KV blocks."""
    arch = arch_from_hf(hf_model)
    runner = ModelRunner(
        ModelConfig(
            model="unused",
            dtype=dtype,  # type: ignore[arg-type]
            attention_backend=attention_backend,
        ),
        CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        arch,
        max_model_len=arch.max_position_embeddings,
        device=device,
    )
    runner.load_model((weights if weights is not None else hf_model.state_dict()).items())
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


class RecordingSampler(Sampler):
    """A real sampler that also keeps every logits row it saw, per request id."""

    def __init__(self) -> None:
        self.logits: dict[str, list[torch.Tensor]] = {}

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        for row, request in enumerate(requests):
            self.logits.setdefault(request.request_id, []).append(logits[row].float().cpu())
        return super().__call__(logits, requests)


class BlockPool:
    """Hands out block ids in order, or shuffled so block tables are non-contiguous."""

    def __init__(self, num_blocks: int, *, shuffle_seed: int | None = None):
        self.free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)

    def allocate(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "test pool ran out of blocks"
        return taken


@dataclass
class Driver:
    """Schedules like the real scheduler would: prefill (optionally in chunks), then decode."""

    runner: ModelRunner
    pool: BlockPool
    block_ids: dict[str, list[int]] = field(default_factory=dict)

    def schedule(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        blocks = self.block_ids.setdefault(request.request_id, [])
        needed = math.ceil((request.num_computed_tokens + num_new_tokens) / self.runner.block_size)
        blocks += self.pool.allocate(needed - len(blocks))
        return ScheduledRequest(request, num_new_tokens, list(blocks))

    def step(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """Runs one step and applies it as the scheduler would (advance, append tokens)."""
        out = self.runner.execute_model(SchedulerOutput(scheduled))
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            token = out.sampled_token_ids.get(s.request.request_id)
            if token is not None:
                s.request.append_output_token(token)
        return out.sampled_token_ids

    def generate(
        self, requests: list[Request], max_new_tokens: int, *, chunk_size: int | None = None
    ) -> dict[str, list[int]]:
        """Runs all requests together until each has `max_new_tokens` outputs."""
        active = list(requests)
        while active:
            scheduled = []
            for r in active:
                n = r.num_tokens - r.num_computed_tokens
                scheduled.append(self.schedule(r, min(n, chunk_size or n)))
            self.step(scheduled)
            active = [r for r in active if r.num_output_tokens < max_new_tokens]
        return {r.request_id: r.output_token_ids for r in requests}


def make_request(
    request_id: str, prompt: list[int], params: SamplingParams | None = None, **kwargs: object
) -> Request:
    return Request(request_id, prompt, params or SamplingParams(temperature=0.0), **kwargs)  # type: ignore[arg-type]


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(
    hf_model: Any, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens and the logits row behind each."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [row[0].float() for row in out.logits]


def assert_greedy_matches(
    ours: list[int],
    our_logits: list[torch.Tensor],
    ref: list[int],
    ref_logits: list[torch.Tensor],
    *,
    length: int = LOGITS_REDUCTION_LENGTH,
) -> None:
    """Tokens equal, except where the reference's top-2 logits are closer than the two sides'
    logits may differ: there the sequences may diverge from that step on. Logits match up to
    reordered fp32 sums `length` long (tests/tolerances.py)."""
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        scale = float(ref_logits[step].abs().max())
        tolerance = reordering_tolerance(torch.float32, length, scale)
        torch.testing.assert_close(our_logits[step], ref_logits[step], **tolerance)
        if a != b:
            top2 = ref_logits[step].topk(2).values
            tie = 2 * (tolerance["atol"] + tolerance["rtol"] * scale)
            assert top2[0] - top2[1] < tie, f"step {step}: token {a} != {b} with a clear margin"
            return


def assert_logits_close(ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> None:
    """Two runs of these models' logits, step by step, equal up to reordered fp32 sums (another
    batch, chunking or kernel; tests/tolerances.py)."""
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        scale = float(b.abs().max())
        tolerance = reordering_tolerance(torch.float32, LOGITS_REDUCTION_LENGTH, scale)
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m, step=step: f"step {step}: {m}")


def greedy_generate(
    runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int
) -> tuple[dict[str, list[int]], RecordingSampler]:
    """Greedy tokens of requests "r0", "r1", ... run together, and the logits behind them."""
    recorder = RecordingSampler()
    runner.sampler = recorder
    requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    tokens = Driver(runner, BlockPool(runner.num_blocks)).generate(requests, max_new_tokens)
    return tokens, recorder


def assert_runner_matches_hf(
    hf_model: Any, runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int = 8
) -> None:
    """`runner` (any device) and HF's greedy `generate` agree on every prompt, run together."""
    tokens, recorder = greedy_generate(runner, prompts, max_new_tokens)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf_model, prompt, max_new_tokens)
        assert_greedy_matches(tokens[f"r{i}"], recorder.logits[f"r{i}"], ref_tokens, ref_logits)
