"""Rebuilds a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata (byte-level BPE).

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types, special
ids and the name of its pre-tokenizer ("tokenizer.ggml.pre"). This module maps those back onto
the `tokenizers` building blocks. Only the "gpt2" (byte-level BPE) tokenizer model is supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.gguf_file import read_gguf

# llama.cpp token types (llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split patterns of llama.cpp's named pre-tokenizers that differ from GPT-2's, by the regex the
# original Hugging Face tokenizer.json uses. Unlisted names fall back to GPT-2's split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# Pre-tokenizers that isolate each digit before GPT-2's split (SmolLM's tokenizer.json does).
_DIGIT_SPLITTING_PRES = {"smollm", "starcoder", "refact"}


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """A tokenizer rebuilt from GGUF metadata, with the facts the wrapper needs."""

    backend: BackendTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def load_gguf_tokenizer(path: str) -> GGUFTokenizerSpec:
    """Builds the tokenizer a GGUF file describes.

    Args:
        path: a .gguf file with tokenizer.ggml.* metadata.

    Returns:
        The backend tokenizer and its special-token facts.

    Raises:
        ModelLoadError: no tokenizer metadata, or a tokenizer model other than "gpt2".
    """
    meta = read_gguf(path).metadata
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ModelLoadError(f"{path}: GGUF tokenizer metadata lacks tokens or merges")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError(
            f"{path}: {len(token_types)} token types for {len(tokens)} tokens in GGUF metadata"
        )
    backend = _byte_level_bpe(tokens, merges, token_types, meta.get("tokenizer.ggml.pre"))
    eos_ids = [
        meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta
    ]
    return GGUFTokenizerSpec(
        backend=backend,
        bos_token_id=_optional_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str | None
) -> BackendTokenizer:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    pairs = [_merge_pair(merge) for merge in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) and user-defined ones must match whole in the text,
    # never be split into bytes; only control tokens count as special (skipped on decode).
    added = [
        AddedToken(token, special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _pre_tokenizer(pre: str | None) -> Any:
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
