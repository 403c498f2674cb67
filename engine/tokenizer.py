"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the special-token facts of its model.

Loaded from a Hugging Face directory (tokenizer.json, tokenizer_config.json) or rebuilt from a
GGUF file's metadata. It never imports transformers; the chat template is rendered with jinja2.
Picklable: the backend serializes itself as its JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import is_gguf_path
from shoal.engine.loader.gguf_tokenizer import load_gguf_tokenizer
from shoal.engine.loader.hf_config import read_json

# Inputs from this size on are tokenized by the batch calls, which release the GIL: a thread
# tokenizing a long text then leaves the others (an event loop) running. Shorter ones take
# the single calls, which cost less.
_LONG_TEXT = 16384
_LONG_IDS = 4096


class Tokenizer:
    """Text <-> token ids for one model.

    Args:
        backend: the `tokenizers` tokenizer.
        bos_token_id: the model's BOS id, if it has one.
        eos_token_ids: ids that end generation.
        add_bos_token: prepend BOS on `encode(add_special_tokens=True)`; None leaves special
            tokens to the backend's own post-processor (a tokenizer.json that adds them itself).
        add_eos_token: append EOS likewise (only when add_bos_token is not None).
        chat_template: a jinja2 chat template, if the model has one.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        add_bos_token: bool | None = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        if bos_token_id is not None:
            special.add(bos_token_id)
        self.all_special_ids: set[int] = special | set(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (the one to append), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS is added only if the model asks for it. Safe to call off
        the event loop: the batch call releases the GIL while it tokenizes."""
        if self.add_bos_token is None:
            return self._encode(text, add_special_tokens)
        ids = self._encode(text, False)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; incomplete UTF-8 at either end decodes to U+FFFD."""
        ids = list(ids)
        if len(ids) < _LONG_IDS:
            return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))
        # The batch call releases the GIL (a single decode holds it throughout).
        [text] = self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)
        return str(text)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) < _LONG_TEXT:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        # The batch call releases the GIL (a single encode holds it throughout).
        [encoding] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary strings of `ids` (byte-level spelling for BPE)."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders `messages` with the model's chat template.

        Args:
            messages: [{"role": ..., "content": ...}, ...].
            add_generation_prompt: end with the assistant turn's header.
            **kwargs: extra template variables.

        Returns:
            The prompt text (tokenize it with `encode(text, add_special_tokens=False)` when the
            template writes BOS itself).

        Raises:
            ValueError: the model has no chat template, or the template raised.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        variables = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
            **kwargs,
        }
        try:
            return template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""


def load_tokenizer(path: str) -> Tokenizer:
    """Loads the tokenizer of a checkpoint.

    Args:
        path: a .gguf file, a Hugging Face directory holding tokenizer.json, or a tokenizer.json
            file (its directory's tokenizer_config.json and config.json are read if present).

    Returns:
        The tokenizer.

    Raises:
        ModelLoadError: the path holds no usable tokenizer.
    """
    if not Path(path).exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if is_gguf_path(path):
        spec = load_gguf_tokenizer(path)
        return Tokenizer(
            spec.backend,
            bos_token_id=spec.bos_token_id,
            eos_token_ids=spec.eos_token_ids,
            add_bos_token=spec.add_bos_token,
            add_eos_token=spec.add_eos_token,
            chat_template=spec.chat_template,
        )
    location = Path(path)
    tokenizer_file = location / "tokenizer.json" if location.is_dir() else location
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{path}: no tokenizer.json (nor a .gguf file) found")
    return _load_hf_tokenizer(tokenizer_file)


def _load_hf_tokenizer(tokenizer_file: Path) -> Tokenizer:
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises a bare Exception for bad JSON
        raise ModelLoadError(f"{tokenizer_file}: not a valid tokenizer.json ({exc})") from exc
    directory = tokenizer_file.parent
    config_path = directory / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    model_config_path = directory / "config.json"
    model_config = read_json(model_config_path) if model_config_path.is_file() else {}

    def special_id(name: str) -> int | None:
        token = config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        return backend.token_to_id(token) if isinstance(token, str) else None

    bos_id = special_id("bos_token")
    if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
        bos_id = model_config["bos_token_id"]
    eos_id = special_id("eos_token")
    eos_ids = (eos_id,) if eos_id is not None else _as_ids(model_config.get("eos_token_id"))
    explicit = "add_bos_token" in config or "add_eos_token" in config
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos_token=bool(config.get("add_bos_token", False)) if explicit else None,
        add_eos_token=bool(config.get("add_eos_token", False)),
        chat_template=_chat_template(config, directory),
    )


def _chat_template(config: dict[str, Any], directory: Path) -> str | None:
    """transformers 5.x saves chat_template.jinja; 4.x kept it in tokenizer_config.json."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return ()
