"""DeepSeek-V3 (and R1): multi-head latent attention (MLA) over a cache of the compressed latent,
and a mixture of routed experts (sigmoid scores, group-limited top-k) beside shared experts.

MLA: keys and values are `kv_b_proj` expansions of one latent c (kv_lora_rank wide) per token,
plus a rotary key part shared by all heads. The cache holds [c | k_rope] only (one row of
kv_lora_rank + qk_rope_head_dim per token and layer, against 2 * heads * head_dim for K/V),
and attention runs in the absorbed form: each head's query is moved into the latent space
(q_nope W_UK, then beside its rotary part), attends over the latent rows as a single KV head
whose values are the rows' first kv_lora_rank entries, and the result leaves through W_UV and
o_proj. Under tensor parallelism the heads are split (q_b_proj, kv_b_proj by heads, o_proj by
their columns); the latent, being one for all heads, is computed and cached by every worker.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.engine.model.attention import AttentionBackend, AttentionMetadata, PagedAttention
from shoal.engine.model.experts import PROJ_EXPERTS, RoutedExperts
from shoal.engine.model.layers import GatedMLP, Linear, RMSNorm, RopeAngles, WeightMap
from shoal.engine.model.llama_layers import SelfAttention
from shoal.engine.model.mixtral import MoEForCausalLM
from shoal.engine.model.moe import GroupedTopKRouter, SparseMoE, expert_kwargs
from shoal.engine.model.rotary import rope_type, yarn_mscale
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.tensor_parallel import SINGLE, Shard, TensorParallel

# HF's q_a_layernorm / kv_a_layernorm keep their class default, not the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def mla_scale(arch: ModelArch) -> float:
    """The softmax scale: (nope + rope) ** -0.5, times yarn's mscale squared when scaled."""
    scale = float(arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
    scaling = arch.rope_scaling
    if rope_type(scaling) != "default" and scaling and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class MLAttention(SelfAttention):
    """Multi-head latent attention caching the latent (see the module docstring)."""

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend[Any],
        *,
        tp: TensorParallel = SINGLE,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.tp, self.arch = tp, arch
        self.heads = tp.shard(arch.num_attention_heads)
        self.num_heads = self.heads.size
        self.nope, self.rope_dim = arch.qk_nope_head_dim, arch.qk_rope_head_dim
        self.latent, self.v_dim = arch.kv_lora_rank, arch.v_head_dim
        hidden, qk_dim = arch.hidden_size, self.nope + self.rope_dim
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.q_a_proj = self.q_a_layernorm = None
        if arch.q_lora_rank:
            self.q_a_proj = Linear(hidden, arch.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, _LATENT_NORM_EPS, **kw)
        q_in = arch.q_lora_rank or hidden
        self.q_proj = Linear(q_in, self.num_heads * qk_dim, **kw)  # q_b_proj when q is low-rank
        self.kv_a_proj_with_mqa = Linear(hidden, self.latent + self.rope_dim, **kw)
        self.kv_a_layernorm = RMSNorm(self.latent, _LATENT_NORM_EPS, **kw)
        self.kv_b_proj = Linear(self.latent, self.num_heads * (self.nope + self.v_dim), **kw)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, **kw)
        self.attn = PagedAttention(
            self.num_heads,
            1,
            self.latent + self.rope_dim,
            backend,
            scale=mla_scale(arch),
            value_dim=self.latent,
        )

    def _rotate(self, rope: RopeAngles, x: torch.Tensor) -> torch.Tensor:
        if self.arch.rope_interleave:
            # Pairs (x0, x1), (x2, x3), ... each turn by one angle: the rotate-half rotation of
            # (evens | odds), as HF computes it.
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return rope.rotate(x)

    def forward(self, rope: RopeAngles, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_in = x
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            q_in = self.q_a_layernorm(self.q_a_proj(x))[0]
        q = self.q_proj(q_in).view(num_tokens, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q[..., : self.nope], self._rotate(rope, q[..., self.nope :])
        kv_a = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv_a[:, : self.latent])[0]
        k_rope = self._rotate(rope, kv_a[:, None, self.latent :])
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        w_uk, w_uv = w_kv[:, : self.nope], w_kv[:, self.nope :]
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        query = torch.cat([q_latent, q_rope], dim=-1)
        key = torch.cat([latent[:, None], k_rope], dim=-1)  # [T, 1, latent + rope]: the cache row
        out = self.attn(query, key, None, meta).view(num_tokens, self.num_heads, self.latent)
        values = torch.einsum("thc,hvc->thv", out, w_uv).reshape(num_tokens, -1)
        return self.tp.all_reduce(self.o_proj(values))

    def weight_map(self, layer_prefix: str) -> WeightMap:
        """HF names under `{layer_prefix}.self_attn`; head-split ones narrowed to this worker's."""
        prefix, arch = f"{layer_prefix}.self_attn", self.arch
        heads, total = self.heads, arch.num_attention_heads
        qk_dim, kv_dim = self.nope + self.rope_dim, self.nope + self.v_dim
        wm = WeightMap()
        q_name = "q_b_proj" if arch.q_lora_rank else "q_proj"
        q_in = arch.q_lora_rank or arch.hidden_size
        _add_head_rows(
            wm, f"{prefix}.{q_name}.weight", self.q_proj.weight, total, qk_dim, q_in, heads
        )
        _add_head_rows(
            wm,
            f"{prefix}.kv_b_proj.weight",
            self.kv_b_proj.weight,
            total,
            kv_dim,
            self.latent,
            heads,
        )
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            wm.add(f"{prefix}.q_a_proj.weight", self.q_a_proj.weight)
            wm.add(f"{prefix}.q_a_layernorm.weight", self.q_a_layernorm.weight)
        wm.add(f"{prefix}.kv_a_proj_with_mqa.weight", self.kv_a_proj_with_mqa.weight)
        wm.add(f"{prefix}.kv_a_layernorm.weight", self.kv_a_layernorm.weight)
        o_cols = Shard(heads.start * self.v_dim, heads.size * self.v_dim)
        shape = (arch.hidden_size, total * self.v_dim)
        wm.add(f"{prefix}.o_proj.weight", self.o_proj.weight, shape=shape, block=(1, o_cols))
        return wm


def _add_head_rows(
    wm: WeightMap, name: str, dest: torch.Tensor, heads: int, rows: int, cols: int, shard: Shard
) -> None:
    """A [heads * rows, cols] weight, narrowed to the rows of the heads in `shard`."""
    block = Shard(shard.start * rows, shard.size * rows)
    wm.add(name, dest, shape=(heads * rows, cols), block=(0, block))


class DeepseekV3ForCausalLM(MoEForCausalLM):
    """DeepSeek-V3 / R1: latent attention in every layer; the first `first_k_dense_replace`
    layers dense, the others routed experts plus shared ones."""

    def _make_attention(
        self,
        arch: ModelArch,
        layer: int,
        backend: AttentionBackend[Any],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> SelfAttention:
        return MLAttention(arch, backend, tp=self.tp, dtype=dtype, device=device)

    def _make_moe(self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device) -> SparseMoE:
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        tp = self.moe_tp
        experts = RoutedExperts(
            arch.num_local_experts,
            arch.hidden_size,
            arch.expert_intermediate_size,
            names=PROJ_EXPERTS,
            **expert_kwargs(arch, self.expert_parallel, tp),
            **kw,
        )
        shared = None
        if arch.num_shared_experts:
            width = arch.num_shared_experts * arch.expert_intermediate_size
            shared = GatedMLP(
                arch.hidden_size, width, tp=self.tp, module_name="mlp.shared_experts", **kw
            )
        return SparseMoE(
            GroupedTopKRouter(arch, **kw),
            experts,
            router_name="mlp.gate",
            shared=shared,
            expert_parallel=self.expert_parallel,
            tp=tp,
        )
