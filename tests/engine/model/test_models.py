"""Llama / Qwen2 / Mixtral against HF transformers: greedy tokens, weight naming, load errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from shoal.engine.errors import ModelLoadError
from shoal.engine.model.layers import Linear, rope_inv_freq
from shoal.engine.model.mixtral import MixtralMoE
from shoal.engine.model.registry import LlamaForCausalLM, MixtralForCausalLM, get_model_class
from shoal.engine.parallel.expert_parallel import ExpertParallel, ExpertPlacement
from tests.engine.model_utils import (
    ARCHITECTURES,
    arch_from_hf,
    assert_runner_matches_hf,
    make_hf_model,
    make_runner,
    random_prompts,
)
from tests.tolerances import assert_reordered_close


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_matches_hf_generate(architecture: str) -> None:
    hf_model = make_hf_model(architecture)
    runner = make_runner(hf_model)
    assert_runner_matches_hf(hf_model, runner, random_prompts([5, 17, 33, 9, 1]))


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MixtralForCausalLM"])
@pytest.mark.parametrize("layout", ["dense", "packed+dense", "packed"])
def test_dense_and_packed_weights_match_hf(
    architecture: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiny weights stay dense on their own; packing them anyway covers oneDNN's path, which the
    # real models take. The dense path is what CUDA, and a CPU without oneDNN, run. A small
    # model keeps its dense weights beside the packed ones, for steps of 1-2 rows (greedy
    # decode here) while its prompts take the packed path; a large one keeps packed only.
    is_packed = layout != "dense"
    if is_packed:
        monkeypatch.setattr("shoal.engine.model.layers.MIN_PACKED_WEIGHT_NUMEL", 0)
    if layout == "packed":
        monkeypatch.setattr("shoal.engine.model.llama.MAX_DUAL_LAYOUT_BYTES", 0)
    hf_model = make_hf_model(architecture)
    runner = make_runner(hf_model)
    assert runner.model is not None
    packable = [m for m in runner.model.modules() if hasattr(m, "packed")]
    assert packable and all((m.packed is not None) == is_packed for m in packable)
    linears = [m for m in packable if isinstance(m, Linear)]
    assert linears and all(m.keeps_dense == (layout == "packed+dense") for m in linears)
    assert all(hasattr(m, "weight") == (layout != "packed") for m in linears)
    assert_runner_matches_hf(hf_model, runner, random_prompts([7, 12], seed=1))


def test_tied_embeddings_without_lm_head_tensor() -> None:
    hf_model = make_hf_model("LlamaForCausalLM", tie_word_embeddings=True)
    arch = arch_from_hf(hf_model)
    assert arch.tie_word_embeddings
    assert "lm_head.weight" in hf_model.state_dict()  # HF lists the tied tensor; accepted
    make_runner(hf_model)
    weights = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    runner = make_runner(hf_model, weights=weights)  # as a saved tied checkpoint has it
    assert_runner_matches_hf(hf_model, runner, random_prompts([6, 11], seed=2))


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_matches_hf(scaling: dict[str, object]) -> None:
    hf_model = make_hf_model(
        "LlamaForCausalLM", rope_scaling=scaling, rope_theta=500000.0, head_dim=32
    )
    arch = arch_from_hf(hf_model)
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == scaling["rope_type"]
    assert not torch.equal(
        rope_inv_freq(32, 500000.0, arch.rope_scaling), rope_inv_freq(32, 500000.0, None)
    )
    assert_runner_matches_hf(hf_model, make_runner(hf_model), random_prompts([70, 40], seed=3))


def test_unsupported_rope_scaling_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="longrope"):
        rope_inv_freq(64, 10000.0, {"rope_type": "longrope", "factor": 4.0})


def test_mixtral_loads_saved_per_expert_names(tmp_path) -> None:
    hf_model = make_hf_model("MixtralForCausalLM")
    hf_model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert any(".block_sparse_moe.experts.0.w1.weight" in name for name in saved)
    runner = make_runner(hf_model, weights=saved)
    assert_runner_matches_hf(hf_model, runner, random_prompts([9, 14], seed=4))


def test_mixtral_expert_shares_sum_to_the_full_layer() -> None:
    hf_model = make_hf_model("MixtralForCausalLM")
    arch = arch_from_hf(hf_model)
    weights = hf_model.state_dict()
    full = MixtralForCausalLM(arch)
    placement = ExpertPlacement((1, 0, 1, 1), 2)  # any table, not only contiguous blocks
    shares = [
        MixtralForCausalLM(arch, expert_parallel=ExpertParallel(placement, rank))
        for rank in range(2)
    ]
    for model in [full, *shares]:
        model.load_weights(weights.items())
    moes = [m.get_submodule("layers.0.mlp") for m in [full, *shares]]
    assert all(isinstance(m, MixtralMoE) for m in moes)
    x = torch.randn(11, arch.hidden_size)
    # The shares and HF sum each token's experts in other orders: equal up to reordered fp32
    # sums over gate/up, down and the top-k combine (tests/tolerances.py).
    length = arch.hidden_size + arch.intermediate_size + arch.num_experts_per_tok
    with torch.no_grad():
        full_out = moes[0](x)
        parts = [m.route_and_compute(x) for m in moes[1:]]
        assert_reordered_close(parts[0] + parts[1], full_out, length=length)
        reference = hf_model.model.layers[0].mlp(x[None])[0]
    assert_reordered_close(full_out, reference, length=length)


def _llama_model_and_weights() -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    hf_model = make_hf_model("LlamaForCausalLM")
    arch = arch_from_hf(hf_model)
    return get_model_class(arch.architecture)(arch), dict(hf_model.state_dict())


def test_load_error_names_a_wrong_shape() -> None:
    model, weights = _llama_model_and_weights()
    name = "model.layers.1.self_attn.k_proj.weight"
    weights[name] = torch.zeros(5, 64)
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight.*\(5, 64\).*\(32, 64\)"):
        model.load_weights(weights.items())


def test_load_error_names_a_missing_tensor() -> None:
    model, weights = _llama_model_and_weights()
    del weights["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        model.load_weights(weights.items())


def test_load_error_names_an_unknown_tensor() -> None:
    model, weights = _llama_model_and_weights()
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(ModelLoadError, match=r"q_norm\.weight"):
        model.load_weights(weights.items())


def test_qwen2_rejects_a_checkpoint_without_qkv_biases() -> None:
    hf_model = make_hf_model("Qwen2ForCausalLM")
    arch = arch_from_hf(hf_model)
    weights = {k: v for k, v in hf_model.state_dict().items() if not k.endswith("bias")}
    with pytest.raises(ModelLoadError, match=r"q_proj\.bias"):
        get_model_class(arch.architecture)(arch).load_weights(weights.items())


def test_unsupported_architecture() -> None:
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        get_model_class("GPT2LMHeadModel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_and_residual_in_place_equal_the_copying_forms(dtype) -> None:
    from shoal.engine.model.layers import RMSNorm, RotaryEmbedding

    rotary = RotaryEmbedding(64, 128, 10000.0, None, dtype=dtype, device=torch.device("cpu"))
    rope = rotary(torch.tensor([0, 5, 127, 3]))
    qkv = torch.randn(4, 5 * 64).to(dtype)  # two q heads and one k head rotated, 2 v untouched
    expected = rope.rotate(qkv[:, :192].reshape(4, 3, 64))
    v_before = qkv[:, 192:].clone()
    rotated = rope.rotate_(qkv[:, :192].view(4, 3, 64))
    assert rotated.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, :192].view(4, 3, 64), expected)
    assert torch.equal(qkv[:, 192:], v_before)
    norm = RMSNorm(64, 1e-5, dtype=dtype, device=torch.device("cpu"))
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype)
    want_sum = x + residual
    want_norm = norm(want_sum.clone())[0]
    got_norm, got_sum = norm(x, residual)
    assert got_sum.data_ptr() == residual.data_ptr()
    assert torch.equal(got_sum, want_sum) and torch.equal(got_norm, want_norm)
