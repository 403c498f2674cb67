"""shoal.engine.detokenizer: streamed text equals a whole decode, split characters, stop strings."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from shoal.engine.detokenizer import IncrementalDetokenizer, check_stop_strings, find_stop_string
from shoal.engine.tokenizer import Tokenizer, load_tokenizer
from tests.factories import make_tokenizer_json, smollm2_path

TEXTS = [
    "Hello, world! The answer is 42.",
    "Emoji 😀 then 👍🏽 and a flag 🇯🇵 end",
    "中文字符测试。日本語のテキスト。",
    "def f(x):\n    return x ** 2  # square\n",
    "  spaced   out\t\ttabs\n\nnewlines ",
    "mixed: café 😀 中 e\u0301 ok",
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_tokenizer(smollm2_path())


def _stream(
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    output_ids: list[int],
    chunk: int = 1,
    **kwargs: bool,
) -> tuple[IncrementalDetokenizer, list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = [
        detokenizer.update(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)
    ]
    return detokenizer, deltas


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_whole_decode(smollm2: Tokenizer, text: str, chunk: int) -> None:
    prompt_ids = smollm2.encode("<|im_start|>assistant\n")
    output_ids = smollm2.encode(text)
    detokenizer, deltas = _stream(smollm2, prompt_ids, output_ids, chunk)
    assert "".join(deltas) == detokenizer.output_text == smollm2.decode(output_ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_emoji_split_across_tokens_waits_for_the_last_byte(smollm2: Tokenizer) -> None:
    output_ids = smollm2.encode("😀")
    assert len(output_ids) == 3  # byte-level: the emoji's 4 bytes span three tokens
    detokenizer = IncrementalDetokenizer(smollm2, smollm2.encode("Smile:"))
    assert [detokenizer.update([token]) for token in output_ids[:-1]] == ["", ""]
    assert detokenizer.update(output_ids[-1:]) == "😀"
    assert detokenizer.output_text == "😀"


def test_token_mixing_a_space_and_half_an_emoji_is_held_whole(smollm2: Tokenizer) -> None:
    output_ids = smollm2.encode("ok 😀")
    assert smollm2.convert_ids_to_tokens(output_ids[-2:]) == ["ĠðŁĺ", "Ģ"]
    _, deltas = _stream(smollm2, [], output_ids)
    assert deltas[-2:] == ["", " 😀"]


def test_cjk_character_split_across_tokens(smollm2: Tokenizer) -> None:
    output_ids = smollm2.encode("符")
    assert len(output_ids) == 2
    detokenizer = IncrementalDetokenizer(smollm2, [])
    assert detokenizer.update(output_ids[:1]) == ""
    assert detokenizer.update(output_ids[1:]) == "符"


def test_flush_emits_a_held_incomplete_tail(smollm2: Tokenizer) -> None:
    output_ids = smollm2.encode("ok😀")[:-1]  # cut the emoji short
    detokenizer, deltas = _stream(smollm2, [], output_ids)
    assert "".join(deltas) == "ok"
    tail = detokenizer.flush()
    assert tail.endswith("\ufffd")
    assert detokenizer.output_text == smollm2.decode(output_ids)
    assert detokenizer.flush() == ""


def test_special_tokens_skipped_or_kept(smollm2: Tokenizer) -> None:
    output_ids = [*smollm2.encode("Done."), 2]  # 2 is <|im_end|>
    skipped, _ = _stream(smollm2, [], output_ids)
    assert skipped.output_text == "Done."
    kept, _ = _stream(smollm2, [], output_ids, skip_special_tokens=False)
    assert kept.output_text == "Done.<|im_end|>"


def test_each_update_decodes_a_bounded_window(smollm2: Tokenizer) -> None:
    lengths: list[int] = []

    class CountingTokenizer(Tokenizer):
        def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
            ids = list(ids)
            lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = CountingTokenizer(smollm2.backend)
    output_ids = smollm2.encode(" ".join(TEXTS) * 8)
    detokenizer, _ = _stream(counting, smollm2.encode("prompt " * 50), output_ids)
    assert len(output_ids) > 300
    assert detokenizer.output_text == smollm2.decode(output_ids)
    assert max(lengths) <= 12  # 5 context tokens + a few held back, never the whole output


def _metaspace_tokenizer(tmp_path: Path) -> Tokenizer:
    """A sentencepiece-style tokenizer: decoding a token alone drops its leading space."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", "hello there"] * 5
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=80, show_progress=False))
    return Tokenizer(backend)


def test_prefix_space_kept_with_sentencepiece_decoder(tmp_path: Path) -> None:
    tokenizer = _metaspace_tokenizer(tmp_path)
    prompt_ids = tokenizer.encode("hello")
    full_ids = tokenizer.encode("hello world there")
    assert full_ids[: len(prompt_ids)] == prompt_ids
    output_ids = full_ids[len(prompt_ids) :]
    assert tokenizer.decode(output_ids[:1]) == "world"[: len(tokenizer.decode(output_ids[:1]))]
    detokenizer, deltas = _stream(tokenizer, prompt_ids, output_ids)
    assert deltas[0].startswith(" ")  # decoding the first token alone would lose this space
    assert detokenizer.output_text == " world there"


def test_tiny_tokenizer_streams(tmp_path: Path) -> None:
    make_tokenizer_json(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    for text in TEXTS:
        output_ids = tokenizer.encode(text)
        detokenizer, _ = _stream(tokenizer, [], output_ids)
        assert detokenizer.output_text == text


# --- stop strings -------------------------------------------------------------------------


def test_stop_string_straddling_two_deltas() -> None:
    text = "Hello wor" + "ld, STO" + "P here"
    assert check_stop_strings(text, len("P here"), ["STOP"], False) == ("STOP", text.index("STOP"))
    assert check_stop_strings(text, len("P here"), ["STOP"], True) == (
        "STOP",
        text.index("STOP") + 4,
    )


def test_earliest_stop_string_wins() -> None:
    text = "abc END then HALT"
    result = check_stop_strings(text, len(text), ["HALT", "END"], False)
    assert result == ("END", 4)


def test_stop_string_entirely_in_old_text_is_not_reported_again() -> None:
    text = "first STOP then more"
    assert check_stop_strings(text, len(" more"), ["STOP"], False) is None
    assert check_stop_strings(text, 0, ["STOP"], False) is None


def test_no_stop_strings() -> None:
    assert check_stop_strings("anything", 3, [], False) is None
    assert check_stop_strings("anything", 3, [""], False) is None
    assert check_stop_strings("anything", 3, ["zzz"], True) is None


def test_stop_strings_on_streamed_tokens(smollm2: Tokenizer) -> None:
    output_ids = smollm2.encode("The result is: 12 <end> trailing text")
    detokenizer = IncrementalDetokenizer(smollm2, [])
    for token in output_ids:
        delta = detokenizer.update([token])
        match = check_stop_strings(detokenizer.output_text, len(delta), ["<end>"], False)
        if match:
            assert detokenizer.output_text[: match[1]] == "The result is: 12 "
            return
    pytest.fail("the stop string was never found")


def test_find_stop_string_is_the_same_check() -> None:
    assert find_stop_string("ab STOP", 3, ["STOP"], True) == ("STOP", 7)
