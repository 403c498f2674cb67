"""shoal.engine.loader: config parsing (both transformers styles), weights vs transformers, GGUF, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import is_gguf_path, load_model_arch, load_weights, smollm2_gguf_path
from shoal.engine.loader.gguf_loader import unpermute_rotary_rows
from shoal.engine.model_arch import SUPPORTED_ARCHITECTURES
from tests.factories import (
    Arch,
    ConfigStyle,
    hf_reference,
    make_tiny_checkpoint,
    make_tiny_gguf,
    smollm2_path,
    write_config_variant,
)

ARCHS: tuple[Arch, ...] = ("llama", "qwen2", "mixtral")


def _edit_config(path: str, **changes: object) -> None:
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def _as_hf_state_dict(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Fuses saved per-expert Mixtral tensors into transformers 5.x's in-memory layout."""
    fused = dict(weights)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.block_sparse_moe"
        if f"{prefix}.gate.weight" not in fused:
            continue
        fused[f"model.layers.{layer}.mlp.gate.weight"] = fused.pop(f"{prefix}.gate.weight")
        experts = sorted(
            {int(k.split(".")[5]) for k in weights if k.startswith(f"{prefix}.experts.")}
        )
        gate_up, down = [], []
        for e in experts:
            w1, w2, w3 = (fused.pop(f"{prefix}.experts.{e}.{w}.weight") for w in ("w1", "w2", "w3"))
            gate_up.append(torch.cat([w1, w3]))
            down.append(w2)
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(down)
    return fused


# --- config.json -> ModelArch -------------------------------------------------------------


@pytest.mark.parametrize("style", ["v5", "v4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_model_arch_matches_transformers_config(
    tmp_path: Path, arch: Arch, style: ConfigStyle
) -> None:
    from transformers import AutoConfig

    path = make_tiny_checkpoint(
        tmp_path, arch, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2, config_style=style
    )
    model_arch = load_model_arch(path)
    config = AutoConfig.from_pretrained(path)

    assert model_arch.architecture == config.architectures[0]
    assert model_arch.vocab_size == config.vocab_size
    assert model_arch.hidden_size == config.hidden_size == 64
    assert model_arch.num_hidden_layers == config.num_hidden_layers
    assert (model_arch.num_attention_heads, model_arch.num_key_value_heads) == (4, 2)
    assert model_arch.head_dim == 16  # head_dim absent/null -> hidden / heads
    assert model_arch.rms_norm_eps == config.rms_norm_eps
    assert model_arch.rope_theta == config.rope_parameters["rope_theta"]
    assert model_arch.max_position_embeddings == 512
    assert model_arch.torch_dtype == "float32"
    assert model_arch.eos_token_ids == (0,)
    assert model_arch.rope_scaling is None
    assert model_arch.attention_bias is (arch == "qwen2")
    assert (model_arch.num_local_experts, model_arch.num_experts_per_tok) == (
        (4, 2) if arch == "mixtral" else (0, 0)
    )


def test_config_style_changes_only_the_spelling(tmp_path: Path) -> None:
    v5 = load_model_arch(make_tiny_checkpoint(tmp_path / "a", "mixtral", dtype="bfloat16"))
    v4 = load_model_arch(
        make_tiny_checkpoint(tmp_path / "b", "mixtral", dtype="bfloat16", config_style="v4")
    )
    assert v4 == v5
    assert v5.torch_dtype == "bfloat16"
    assert v5.rope_theta == 1e6  # Mixtral's default, read from rope_parameters / rope_theta


@pytest.mark.parametrize("style", ["v5", "v4"])
def test_llama3_rope_scaling_is_kept(tmp_path: Path, style: ConfigStyle) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    _edit_config(path, rope_parameters={"rope_theta": 500000.0, **scaling})
    write_config_variant(path, style)
    arch = load_model_arch(path)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == scaling


def test_head_dim_eos_list_and_tied_embeddings(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    _edit_config(path, head_dim=32, eos_token_id=[0, 2])
    arch = load_model_arch(path)
    assert arch.head_dim == 32
    assert arch.eos_token_ids == (0, 2)
    assert arch.tie_word_embeddings


def test_generation_config_adds_eos_ids(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_model_arch(path).eos_token_ids == (0, 2)


# --- safetensors weights ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "sharded", "tied"),
    [
        ("llama", False, False),
        ("llama", True, True),
        ("qwen2", True, False),
        ("mixtral", False, False),
        ("mixtral", True, True),
    ],
)
def test_weights_equal_transformers_state_dict(
    tmp_path: Path, arch: Arch, sharded: bool, tied: bool
) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, sharded=sharded, tie_word_embeddings=tied)
    if sharded:
        assert len(list(Path(path).glob("model-*.safetensors"))) > 1
    weights = dict(load_weights(path))
    reference = hf_reference(path).state_dict()

    assert ("lm_head.weight" in weights) is not tied
    if arch == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in weights
        weights = _as_hf_state_dict(weights, num_layers=2)
    if tied:
        reference.pop("lm_head.weight")
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def test_weights_keep_the_stored_dtype(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen2", dtype="bfloat16")
    weights = dict(load_weights(path))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert weights["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)


# --- error cases --------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    for call in (load_model_arch, load_weights):
        with pytest.raises(ModelLoadError, match="nowhere"):
            call(missing)


def test_missing_config(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    os.remove(Path(path) / "config.json")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model_arch(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    _edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
        load_model_arch(path)
    assert path in str(info.value)


def test_missing_required_key(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    _edit_config(path, hidden_size=None)
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model_arch(path)


def test_missing_weights(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    os.remove(Path(path) / "model.safetensors")
    for call in (load_model_arch, load_weights):
        with pytest.raises(ModelLoadError, match="no weights"):
            call(path)


def test_missing_shard(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", sharded=True)
    victim = sorted(Path(path).glob("model-*.safetensors"))[-1]
    victim.unlink()
    for call in (load_model_arch, load_weights):
        with pytest.raises(ModelLoadError, match=victim.name):
            call(path)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", sharded=True)
    index_path = Path(path) / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = first_shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.9\.mlp\.up_proj"):
        list(load_weights(path))


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_corrupt_safetensors(tmp_path: Path, damage: str) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    file = Path(path) / "model.safetensors"
    data = file.read_bytes()
    if damage == "truncate":
        file.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "garbage_header":
        file.write_bytes(b"\xff" * 8 + data[8:])
    else:
        file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        list(load_weights(path))


def test_unsupported_feature_is_refused(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen2")
    _edit_config(path, hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not supported"):
        load_model_arch(path)


def test_qwen_sliding_layers_follow_use_sliding_window(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen2", num_layers=3)
    assert load_model_arch(path).sliding_window is None  # off unless use_sliding_window
    _edit_config(path, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    config = json.loads((Path(path) / "config.json").read_text())
    config.pop("layer_types", None)  # as a transformers 4.x config has it
    (Path(path) / "config.json").write_text(json.dumps(config))
    arch = load_model_arch(path)
    assert arch.sliding_window == 8
    assert [arch.window_of(i) for i in range(3)] == [None, 8, 8]
    assert arch.kv_window is None  # a full layer reads every block


# --- GGUF ---------------------------------------------------------------------------------


def test_rotary_unpermute_inverts_llama_cpp_permute() -> None:
    from tests.gguf_factories import _llama_cpp_permute

    weight = torch.randn(3 * 8, 5)
    permuted = torch.from_numpy(_llama_cpp_permute(weight.numpy(), 3))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary_rows(permuted, 3), weight)
    bias = torch.arange(16.0)
    assert torch.equal(
        unpermute_rotary_rows(torch.from_numpy(_llama_cpp_permute(bias.numpy(), 2)), 2), bias
    )


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_round_trips_to_hf_weights(tmp_path: Path, tied: bool) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "hf", "llama", tie_word_embeddings=tied)
    gguf_path = make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint, qtype="F32")
    assert is_gguf_path(gguf_path)

    arch, hf_arch = load_model_arch(gguf_path), load_model_arch(checkpoint)
    assert arch.tie_word_embeddings is tied
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    ):
        assert getattr(arch, field) == getattr(hf_arch, field), field
    assert arch.rms_norm_eps == pytest.approx(hf_arch.rms_norm_eps)
    assert arch.eos_token_ids == (0,)

    ours = dict(load_weights(gguf_path))
    expected = dict(load_weights(checkpoint))
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


def test_quantized_gguf_dequantizes_close_to_the_original(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "hf", "llama")
    gguf_path = make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint, qtype="Q8_0")
    expected = dict(load_weights(checkpoint))
    for name, tensor in load_weights(gguf_path):
        assert tensor.dtype == torch.float32 and tensor.shape == expected[name].shape, name
        # Q8_0: 8-bit per block of 32; error well under 1% of the block's max magnitude.
        scale = expected[name].abs().max()
        assert (tensor - expected[name]).abs().max() < 0.01 * scale, name


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "hf", "llama")
    gguf_path = make_tiny_gguf(tmp_path / "gpt2.gguf", checkpoint, architecture="gpt2")
    for call in (load_model_arch, load_weights):
        with pytest.raises(ModelLoadError, match="'gpt2'") as info:
            call(gguf_path)
        assert "gpt2.gguf" in str(info.value)


def test_truncated_gguf(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "hf", "llama")
    gguf_path = Path(make_tiny_gguf(tmp_path / "cut.gguf", checkpoint))
    data = gguf_path.read_bytes()
    gguf_path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        load_model_arch(str(gguf_path))
    gguf_path.write_bytes(data[:100])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load_model_arch(str(gguf_path))


def test_smollm2_gguf_path_points_at_the_wheel_file() -> None:
    path = smollm2_path()
    assert path == smollm2_gguf_path()
    assert Path(path).name == "SmolLM2-135M-Instruct.Q4_1.gguf" and Path(path).is_file()


def test_smollm2_model_arch() -> None:
    arch = load_model_arch(smollm2_path())
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.max_position_embeddings) == (49152, 8192)
    assert arch.rope_theta == 100000.0
    assert arch.tie_word_embeddings and arch.torch_dtype == "float32"
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))


@pytest.mark.slow
def test_smollm2_gguf_weights_equal_transformers() -> None:
    path = smollm2_path()
    model = hf_reference(path)
    reference = model.state_dict()
    assert model.config.tie_word_embeddings
    reference.pop("lm_head.weight")
    num_seen = 0
    for name, tensor in load_weights(path):
        assert tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name]), name
        num_seen += 1
    assert num_seen == len(reference)


@pytest.mark.parametrize(
    "arch", ["qwen3", "mistral", "qwen3_moe", "phi3", "gpt_oss", "deepseek_v3"]
)
def test_newer_architectures_read_the_same_from_either_config_style(
    tmp_path: Path, arch: Arch
) -> None:
    """transformers 4.x configs lack `layer_types` and `rope_parameters`: the windows, MoE
    and latent attention facts come out the same from the switches they had instead."""
    v5 = load_model_arch(make_tiny_checkpoint(tmp_path / "v5", arch))
    v4 = load_model_arch(make_tiny_checkpoint(tmp_path / "v4", arch, config_style="v4"))
    assert v4 == v5
    assert v5.architecture in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize(
    ("arch", "changes", "reason"),
    [
        ("phi3", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4"),
        ("phi3", {"partial_rotary_factor": 0.75}, "partial rotary"),
    ],
)
def test_what_a_newer_architecture_does_not_implement_is_refused_at_load(
    tmp_path: Path, arch: Arch, changes: dict[str, object], reason: str
) -> None:
    path = make_tiny_checkpoint(tmp_path, arch)
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    if "rope_scaling" in changes:
        config.pop("rope_parameters", None)
    config.update(changes)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=reason):
        load_model_arch(path)
