"""shoal.engine.tokenizer: parity with transformers on SmolLM2's GGUF, special tokens, BOS, pickling."""

from __future__ import annotations

import json
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import processors

from shoal.engine.errors import ModelLoadError
from shoal.engine.tokenizer import Tokenizer, load_tokenizer
from tests.factories import (
    CHATML_TEMPLATE,
    make_tiny_checkpoint,
    make_tiny_gguf,
    make_tokenizer_json,
    smollm2_path,
)

VARIED_TEXTS = [
    "Hello, world! How are you today?",
    "The year 2024 had 366 days; pi is 3.14159.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "a  b   c    d\t\te\n\n\nf \r\n g",
    "   leading and trailing spaces   ",
    "Emoji: 😀👍🏽🇫🇷 and ❤️ family 👨‍👩‍👧",
    "中文字符测试。日本語のテキスト。한국어 문장.",
    "Ünïcödé café naïve résumé Zürich Ελληνικά русский",
    "don't won't I'll we've they're it's",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "http://example.com/path?q=1&r=two#frag",
    "",
    " ",
    "x" * 100,
]
# HF's GGUF converter (transformers 5.24) gives SmolLM2 GPT-2's split without isolating digits
# first, while llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) isolate
# them. The two disagree only where a run of 2+ whitespace characters meets a digit.
_DIGIT_AFTER_WHITESPACE_RUN = re.compile(r"\s{2,}(?=\d)")


def _random_texts(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = " \n\tabcdefXYZ0123456789.,;:'\"!?-_()[]{}<>|/\\éß中文😀ñ"
    texts: list[str] = []
    while len(texts) < num:
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        if not _DIGIT_AFTER_WHITESPACE_RUN.search(text):
            texts.append(text)
    return texts


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_tokenizer(smollm2_path())


@pytest.fixture(scope="module")
def hf_smollm2() -> Any:
    from transformers import AutoTokenizer

    path = Path(smollm2_path())
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    make_tokenizer_json(tmp_path)
    return tmp_path


def test_smollm2_special_tokens(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == (2,)
    assert {0, 1, 2} <= smollm2.all_special_ids
    assert len(smollm2.all_special_ids) == 17  # the 17 control tokens of the GGUF
    assert smollm2.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_smollm2_adds_no_bos_and_keeps_special_tokens_whole(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # matched whole, not split into "<", "|", ...
    assert smollm2.encode("hi")[0] != smollm2.bos_token_id


@pytest.mark.slow
def test_smollm2_encode_matches_transformers(smollm2: Tokenizer, hf_smollm2: Any) -> None:
    for text in VARIED_TEXTS + _random_texts(300):
        assert smollm2.encode(text) == hf_smollm2.encode(text), repr(text)
        assert smollm2.encode(text, add_special_tokens=False) == hf_smollm2.encode(
            text, add_special_tokens=False
        ), repr(text)


@pytest.mark.slow
def test_smollm2_decode_matches_transformers(smollm2: Tokenizer, hf_smollm2: Any) -> None:
    for text in VARIED_TEXTS:
        ids = smollm2.encode(text)
        for skip in (True, False):
            assert smollm2.decode(ids, skip_special_tokens=skip) == hf_smollm2.decode(
                ids, skip_special_tokens=skip
            ), repr(text)


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2: Tokenizer, hf_smollm2: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    for add_generation_prompt in (True, False):
        ours = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        expected = hf_smollm2.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == expected


def test_smollm2_isolates_digits_like_llama_cpp(smollm2: Tokenizer) -> None:
    # "\t\t" stays one token because the digit is split off before GPT-2's regex runs.
    tokens = smollm2.convert_ids_to_tokens(smollm2.encode("x\t\t8"))
    assert tokens == ["x", "\u0109\u0109", "8"]
    assert smollm2.convert_ids_to_tokens(smollm2.encode("12345")) == list("12345")


def test_decode_round_trips(smollm2: Tokenizer) -> None:
    for text in VARIED_TEXTS + _random_texts(100, seed=1):
        ids = smollm2.encode(text)
        assert smollm2.decode(ids, skip_special_tokens=False) == text, repr(text)


def test_skip_special_tokens(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>assistant\nSure.<|im_end|>")
    assert smollm2.decode(ids) == "assistant\nSure."
    assert smollm2.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")


def test_tokenizer_pickles(smollm2: Tokenizer) -> None:
    clone = pickle.loads(pickle.dumps(smollm2))
    for text in VARIED_TEXTS:
        assert clone.encode(text) == smollm2.encode(text)
    assert clone.eos_token_ids == smollm2.eos_token_ids
    assert clone.all_special_ids == smollm2.all_special_ids


def test_tiny_tokenizer_from_directory_and_file(tiny_dir: Path) -> None:
    from_dir = load_tokenizer(str(tiny_dir))
    from_file = load_tokenizer(str(tiny_dir / "tokenizer.json"))
    assert 400 <= from_dir.vocab_size <= 512
    assert from_dir.eos_token_ids == (0,) and from_dir.bos_token_id == 0
    assert from_dir.convert_ids_to_tokens([0, 1, 2]) == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    text = "The quick brown fox jumps over the lazy dog. 東京 😀"
    assert from_dir.encode(text) == from_file.encode(text)
    assert from_dir.encode(text)[0] != 0  # add_bos_token is false
    assert from_dir.decode(from_dir.encode(text)) == text


def test_tiny_tokenizer_gguf_matches_tokenizer_json(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "hf", "llama")
    from_json = load_tokenizer(checkpoint)
    from_gguf = load_tokenizer(make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint))
    assert from_gguf.vocab_size == from_json.vocab_size
    assert from_gguf.eos_token_ids == from_json.eos_token_ids
    for text in VARIED_TEXTS + _random_texts(100, seed=2):
        assert from_gguf.encode(text) == from_json.encode(text), repr(text)
    assert from_gguf.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_add_bos_token_from_tokenizer_config(tiny_dir: Path) -> None:
    config_path = tiny_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=True, bos_token="<|im_start|>")
    config_path.write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(tiny_dir))
    assert tokenizer.encode("hello")[0] == 1
    assert tokenizer.encode("hello", add_special_tokens=False)[0] != 1


def test_backend_post_processor_adds_bos_when_config_is_silent(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    backend = tokenizer.backend
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tiny_dir / "tokenizer.json"))
    (tiny_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    reloaded = load_tokenizer(str(tiny_dir))
    assert reloaded.encode("hello")[0] == 1
    assert reloaded.encode("hello", add_special_tokens=False)[0] != 1


def test_chat_template_from_jinja_file(tiny_dir: Path) -> None:
    (tiny_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    tokenizer = load_tokenizer(str(tiny_dir))
    assert tokenizer.chat_template != CHATML_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "yo"}])
    assert text == "[user] yo\n"


def test_missing_chat_template_raises(tiny_dir: Path) -> None:
    (tiny_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(str(tiny_dir)).apply_chat_template([{"role": "user", "content": "x"}])


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"missing: no such file or directory$"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def test_tokenizer_and_metadata_need_no_torch(tmp_path: Path) -> None:
    """Clients tokenize and read ModelArch; they must not pay torch's import time."""
    checkpoint = make_tiny_checkpoint(tmp_path, "llama")
    code = (
        "import sys; from shoal.engine.detokenizer import IncrementalDetokenizer; "
        "from shoal.engine.loader import load_model_arch; "
        "from shoal.engine.tokenizer import load_tokenizer; "
        f"[load_model_arch(p) and load_tokenizer(p) for p in ({checkpoint!r}, {smollm2_path()!r})]; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
