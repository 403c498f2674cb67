"""vLLM's serve flags that shoal has no engine field for: truthful no-ops and one-line refusals.

A vLLM launch script should either work or fail on its first line. Flags whose vLLM meaning
shoal already has (eager execution, no remote code, no request log, every layer on each rank) are
accepted and say so in `--help`; a flag for something shoal does not do ends the command with
exit code 2 and one line naming what to do instead, before anything starts. `HelpFormatter`
shows every flag's default.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

# vLLM flags for features shoal lacks, each with the line that refuses it.
_REFUSED: dict[tuple[str, ...], str] = {
    ("--quantization", "-q"): (
        "shoal serves the checkpoint's own weights; to serve a quantized model, pass a "
        "quantized .gguf file as the model"
    ),
    ("--kv-cache-dtype",): "the KV cache is held in the model's dtype (set it with --dtype)",
    ("--speculative-config",): "speculative decoding is not supported; serve without it",
    ("--enable-lora", "--lora-modules"): (
        "LoRA adapters are not supported; merge the adapter into the checkpoint and serve that"
    ),
    ("--cpu-offload-gb",): "weights are not offloaded; give ranks more memory or more ranks",
    ("--distributed-executor-backend",): (
        "shoal always runs each rank as a Ray actor; there is no executor to choose"
    ),
    ("--revision", "--download-dir", "--load-format"): (
        "shoal downloads nothing; pass a local Hugging Face directory or .gguf file as the model"
    ),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every flag's help unless the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class _ReasonedAction(argparse.Action):
    """A flag that may end parsing with one line (exit 2) saying `reason`."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.reason: str = kwargs.pop("reason")
        super().__init__(option_strings, dest, **kwargs)

    def refuse(self, parser: argparse.ArgumentParser, what: str) -> None:
        parser.exit(2, f"{parser.prog}: {what}: {self.reason}\n")


class _Refuse(_ReasonedAction):
    """Ends parsing with one line (exit 2): the flag's feature is missing in shoal."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "?")
        kwargs.setdefault("default", argparse.SUPPRESS)  # never in the namespace
        kwargs.setdefault("metavar", "VALUE")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        self.refuse(parser, f"{option_string} is not supported")


class _Only(_ReasonedAction):
    """A flag shoal accepts at its default value only; another ends parsing with one line."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values != self.default:
            self.refuse(parser, f"{option_string} {values}")
        setattr(namespace, self.dest, values)


def add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags of `shoal serve` that map onto no engine field (see the module doc)."""
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        action=_Only,
        reason="pipeline parallelism is not supported; each rank runs on one device, and "
        "--data-parallel-size N serves on N of them",
        help="only 1: each rank holds every layer (scale out with --data-parallel-size)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="accepted as in vLLM; shoal always runs eagerly (it captures no CUDA graphs)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted as in vLLM; shoal runs only its own model code and never code shipped "
        "with a checkpoint",
    )
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted as in vLLM; shoal never logs requests",
    )
    for flags, reason in _REFUSED.items():
        parser.add_argument(*flags, action=_Refuse, reason=reason, help=f"refused: {reason}")
