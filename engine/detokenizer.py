"""Incremental detokenization of a generated stream, and stop-string matching on its text.

Each update decodes only a small window of recent tokens (the prefix / read offsets of vLLM's
design), so its cost does not grow with the output. It knows nothing of requests or sampling;
whoever owns the request decides what to do with a stop match.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.engine.tokenizer import Tokenizer

# Tokens of context decoded before the first new token, so the first delta gets the spacing a
# whole-sequence decode would give it (sentencepiece drops a leading space on a lone token).
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Invariant: `output_text` is the decode of every output token up to `read_offset`; tokens
    after it are held back because their bytes end in an incomplete UTF-8 character.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt, used only as decoding context.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self.num_context_tokens = len(self.token_ids)
        # token_ids[prefix_offset:read_offset] was already emitted and anchors the next decode.
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_context_tokens :]

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Appends generated tokens and returns the text they complete (possibly "").

        Args:
            new_token_ids: the tokens sampled since the last update.

        Returns:
            The new text; also appended to `output_text`.
        """
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        # A trailing U+FFFD means the last bytes are an unfinished character: wait for more.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Emits held-back tokens as they are (with U+FFFD for broken bytes); call at finish."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(
            self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens
        )


def check_stop_strings(
    text: str,
    new_delta_len: int,
    stop: Sequence[str],
    include_stop_str_in_output: bool,
) -> tuple[str, int] | None:
    """Finds the earliest stop string that the latest delta completed.

    Only matches ending inside the last `new_delta_len` characters are considered (older ones
    were checked before), but a match may start in earlier text: a stop string can straddle
    two deltas.

    Args:
        text: the output text so far, delta included.
        new_delta_len: length of the delta just appended to `text`.
        stop: the stop strings.
        include_stop_str_in_output: keep the stop string in the output.

    Returns:
        (stop string, length to truncate `text` to), or None when nothing matched.
    """
    if new_delta_len <= 0:
        return None
    best: tuple[int, int, str] | None = None  # (start, end, stop string)
    for stop_str in stop:
        if not stop_str:
            continue
        # The match must end after the old text, so it starts no earlier than this.
        search_from = max(0, len(text) - new_delta_len - len(stop_str) + 1)
        start = text.find(stop_str, search_from)
        if start < 0:
            continue
        end = start + len(stop_str)
        if best is None or (start, end) < (best[0], best[1]):
            best = (start, end, stop_str)
    if best is None:
        return None
    start, end, stop_str = best
    return stop_str, end if include_stop_str_in_output else start


# The name the output processor uses.
find_stop_string = check_stop_strings
