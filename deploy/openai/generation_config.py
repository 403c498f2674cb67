"""`--generation-config`: the sampling defaults a front end applies where a request is silent.

As in vLLM: `vllm` (shoal's default) applies none; `auto` reads the model's own
generation_config.json; a folder reads the generation_config.json in it. Only the fields vLLM
takes from the file are used (`temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` as `max_tokens`); a request that sets one of them
(to anything but null) keeps its own value.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's name -> SamplingParams' name, with the type each must have.
_FIELDS: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)),
    "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", int),
    "min_p": ("min_p", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
    "max_new_tokens": ("max_tokens", int),
}


def load_generation_defaults(choice: str, model: str) -> dict[str, Any]:
    """The request defaults of `--generation-config CHOICE` for `model`, named as in
    `SamplingParams`.

    Raises:
        ValueError: `auto` for a model directory this node cannot read, a folder without a
            readable generation_config.json, or a file that is not a JSON object.
    """
    if choice == "vllm":
        return {}
    if choice == "auto":
        if model.endswith(".gguf"):
            return {}  # a GGUF file carries no generation config
        if not os.path.isdir(model):
            raise ValueError(
                f"--generation-config auto: the model directory {model} is not on this node; "
                "give --generation-config FOLDER (a copy of its generation_config.json) or vllm"
            )
        path = Path(model) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return {}  # the model sets no defaults
    else:
        path = Path(choice) / GENERATION_CONFIG_FILE
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from e
    if not isinstance(document, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    return _defaults_of(document, path)


def _defaults_of(document: dict[str, Any], path: Path) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for key, (name, kind) in _FIELDS.items():
        value = document.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"--generation-config: {key} in {path} is not a number: {value!r}")
        defaults[name] = value
    return defaults
