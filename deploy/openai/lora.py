"""LoRA adapters on the OpenAI front end, as vLLM serves them: `--lora-modules` (`name=path`
or vLLM's JSON form), the served adapters by name (`LoRAModules`: a request's `model` picks
one, `/v1/models` lists them under their parent), and `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter`, which take the admin key.

An adapter's folder is checked here on its own (files, options, rank; `inspect_adapter`); each
engine checks its modules against the base when a request first brings it, and fails only that
request if they do not fit.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus

from pydantic import BaseModel

from shoal.deploy.openai.errors import OpenAIError
from shoal.engine.lora.adapter import AdapterError, inspect_adapter
from shoal.engine.lora.config import LoRAConfig
from shoal.engine.protocol import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: the adapter's served name, its folder and (vLLM's JSON
    form) the base it was trained on, shown as its parent (default: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path`, or `{"name": ..., "path": ..., "base_model_name": ...}`.

    Raises:
        ValueError: neither form (argparse reports it as a bad value).
    """
    if text.lstrip().startswith("{"):
        fields = json.loads(text)
        if not isinstance(fields, dict) or not {"name", "path"} <= fields.keys():
            raise ValueError("a JSON LoRA module needs name and path")
        base = fields.get("base_model_name")
        return LoRAModule(str(fields["name"]), str(fields["path"]), base and str(base))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError("a LoRA module is name=path")
    return LoRAModule(name, path)


def add_lora_args(group: argparse._ArgumentGroup) -> None:
    """--lora-modules."""
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served by name (with --enable-lora): name=path, or vLLM's JSON "
        '{"name": ..., "path": ..., "base_model_name": ...} (default: none)',
    )


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModules:
    """The adapters one front end serves, by name; ids are handed out from 1."""

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[LoRARequest, str | None]] = {}
        self._ids = itertools.count(1)

    def get(self, name: str) -> LoRARequest | None:
        entry = self._by_name.get(name)
        return None if entry is None else entry[0]

    def parents(self, base: str) -> list[tuple[LoRARequest, str]]:
        """Each adapter and its parent (its `base_model_name`, else `base`), in load order."""
        return [(lora, parent or base) for lora, parent in self._by_name.values()]

    def add(self, module: LoRAModule, config: LoRAConfig, taken: Iterable[str]) -> LoRARequest:
        """Serves one more adapter.

        Args:
            module: its name, folder and parent.
            config: the engines' LoRA limits.
            taken: the base model's served names.

        Raises:
            OpenAIError: LoRA is off, the name is taken, or the folder is not an adapter that
                fits (400).
        """
        if not config.enable_lora:
            raise OpenAIError("LoRA adapters need engines started with --enable-lora")
        if module.name in self._by_name or module.name in set(taken):
            raise OpenAIError(f"the model name `{module.name}` is taken", param="lora_name")
        try:
            inspect_adapter(module.path, config.max_lora_rank)
        except AdapterError as e:
            raise OpenAIError(str(e), param="lora_path") from None
        lora = LoRARequest(module.name, next(self._ids), module.path)
        self._by_name[module.name] = (lora, module.base_model_name)
        return lora

    def remove(self, name: str) -> None:
        """Stops serving an adapter (requests already running with it finish).

        Raises:
            OpenAIError: no adapter of that name (404).
        """
        if self._by_name.pop(name, None) is None:
            raise OpenAIError(
                f"the LoRA adapter `{name}` is not loaded",
                HTTPStatus.NOT_FOUND,
                param="lora_name",
            )


def serve_lora_modules(
    modules: Iterable[LoRAModule], config: LoRAConfig, taken: Iterable[str]
) -> LoRAModules:
    """The adapters of `--lora-modules`, each checked.

    Raises:
        ValueError: one cannot be served (the launch stops, saying which and why).
    """
    loras, names = LoRAModules(), tuple(taken)
    for module in modules:
        try:
            loras.add(module, config, names)
        except OpenAIError as e:
            raise ValueError(f"--lora-modules {module.name}: {e.message}") from None
    return loras
