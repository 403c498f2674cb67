"""vLLM's 40 most used `vllm serve` flags, and what `shoal serve` does with each: one table.

A vLLM launch script should either work or fail on its first line. Each flag of
`VLLM_SERVE_FLAGS` is one of:

- SERVED: shoal has the feature under vLLM's name (defined with the engine's, the front end's
  or the launch's flags);
- ACCEPTED: its vLLM meaning is what shoal always does (eager execution, no remote code, no
  request or stats log, recompute instead of swap), so it is a truthful no-op;
- ONLY: accepted at one value (the one shoal does), any other ends the command;
- REFUSED: a feature shoal does not have.

A refusal ends the command with exit code 2 and one line naming what to do instead, before
anything starts. `HelpFormatter` shows every flag's default.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class Verdict(enum.Enum):
    SERVED = "served"
    ACCEPTED = "accepted"
    ONLY = "only"
    REFUSED = "refused"


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM serve flag and shoal's answer to it.

    Attributes:
        names: the flag and its aliases, as vLLM spells them.
        verdict: what shoal does with it.
        line: the help (ACCEPTED: what shoal does instead) or the one-line refusal.
        example: a vLLM command line's use of the flag (for ONLY, with another value).
        value: ONLY: the one value accepted (its default); ACCEPTED: None for an on/off flag,
            else its default.
    """

    names: tuple[str, ...]
    verdict: Verdict
    line: str = ""
    example: tuple[str, ...] = ()
    value: Any = None


_S, _A, _O, _R = Verdict.SERVED, Verdict.ACCEPTED, Verdict.ONLY, Verdict.REFUSED

VLLM_SERVE_FLAGS: tuple[VllmFlag, ...] = (
    # The model, and where it comes from.
    VllmFlag(("--model",), _S, example=("--model", "/models/llama")),
    VllmFlag(("--tokenizer",), _S, example=("--tokenizer", "/models/tok")),
    VllmFlag(("--revision",), _S, example=("--revision", "v1.0")),
    VllmFlag(("--enable-lora",), _S, example=("--enable-lora",)),
    VllmFlag(("--download-dir",), _S, example=("--download-dir", "/models")),
    VllmFlag(("--dtype",), _S, example=("--dtype", "bfloat16")),
    VllmFlag(("--max-model-len",), _S, example=("--max-model-len", "4096")),
    VllmFlag(("--seed",), _S, example=("--seed", "0")),
    VllmFlag(("--runner",), _S, example=("--runner", "pooling")),
    VllmFlag(("--pooler-config",), _S, example=("--pooler-config", '{"pooling_type": "MEAN"}')),
    # Parallelism.
    VllmFlag(("--tensor-parallel-size", "-tp"), _S, example=("-tp", "2")),
    VllmFlag(("--data-parallel-size", "-dp"), _S, example=("-dp", "2")),
    # Memory and batching.
    VllmFlag(("--gpu-memory-utilization",), _S, example=("--gpu-memory-utilization", "0.8")),
    VllmFlag(("--max-num-seqs",), _S, example=("--max-num-seqs", "64")),
    VllmFlag(("--max-num-batched-tokens",), _S, example=("--max-num-batched-tokens", "8192")),
    VllmFlag(("--enable-prefix-caching",), _S, example=("--no-enable-prefix-caching",)),
    VllmFlag(("--enable-chunked-prefill",), _S, example=("--no-enable-chunked-prefill",)),
    # The OpenAI front end.
    VllmFlag(("--host",), _S, example=("--host", "127.0.0.1")),
    VllmFlag(("--port",), _S, example=("--port", "8001")),
    VllmFlag(("--api-key",), _S, example=("--api-key", "KEY")),
    VllmFlag(("--served-model-name",), _S, example=("--served-model-name", "llama")),
    VllmFlag(("--chat-template",), _S, example=("--chat-template", "{{ messages }}")),
    VllmFlag(("--generation-config",), _S, example=("--generation-config", "auto")),
    VllmFlag(("--enable-auto-tool-choice",), _S, example=("--enable-auto-tool-choice",)),
    VllmFlag(("--tool-call-parser",), _S, example=("--tool-call-parser", "hermes")),
    # What shoal always does.
    VllmFlag(
        ("--enforce-eager",),
        _A,
        "accepted as in vLLM; shoal's engine always runs eagerly (it captures no CUDA "
        "graphs); with --engine vllm, vLLM's engine runs eagerly",
        ("--enforce-eager",),
    ),
    VllmFlag(
        ("--trust-remote-code",),
        _A,
        "accepted as in vLLM; shoal runs only its own model code and never code shipped with a "
        "checkpoint",
        ("--trust-remote-code",),
    ),
    VllmFlag(
        ("--disable-log-requests",),
        _A,
        "accepted as in vLLM; shoal never logs requests",
        ("--disable-log-requests",),
    ),
    VllmFlag(
        ("--disable-log-stats",),
        _A,
        "accepted as in vLLM; shoal logs no periodic stats (they are in /metrics)",
        ("--disable-log-stats",),
    ),
    VllmFlag(
        ("--swap-space",),
        _A,
        "accepted as in vLLM V1, which ignores it: a preempted request is recomputed, nothing "
        "is swapped to CPU memory",
        ("--swap-space", "16"),
        value=4.0,
    ),
    # Accepted at one value.
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"),
        _O,
        "pipeline parallelism is not supported; each rank holds every layer, and "
        "--data-parallel-size N (or -tp N) serves on N devices",
        ("-pp", "2"),
        value=1,
    ),
    VllmFlag(
        ("--load-format",),
        _O,
        "shoal reads a checkpoint's safetensors or its GGUF file, whichever it holds",
        ("--load-format", "pt"),
        value="auto",
    ),
    VllmFlag(
        ("--kv-cache-dtype",),
        _O,
        "the KV cache is held in the model's dtype (set that with --dtype)",
        ("--kv-cache-dtype", "fp8"),
        value="auto",
    ),
    VllmFlag(
        ("--distributed-executor-backend",),
        _O,
        "shoal always runs each rank as a Ray actor",
        ("--distributed-executor-backend", "mp"),
        value="ray",
    ),
    # Refused.
    VllmFlag(
        ("--quantization", "-q"),
        _R,
        "shoal serves the checkpoint's own weights; to serve a quantized model, pass a "
        "quantized .gguf file as the model",
        ("--quantization", "awq"),
    ),
    VllmFlag(
        ("--speculative-config",),
        _R,
        "speculative decoding is not supported; serve without it",
        ("--speculative-config", '{"method": "ngram"}'),
    ),
    VllmFlag(
        ("--cpu-offload-gb",),
        _R,
        "weights are not offloaded; give ranks more memory or more ranks",
        ("--cpu-offload-gb", "4"),
    ),
    VllmFlag(
        ("--reasoning-parser",),
        _R,
        "reasoning is not split from the answer: a model's thinking stays in the content",
        ("--reasoning-parser", "deepseek_r1"),
    ),
    VllmFlag(
        ("--limit-mm-per-prompt",),
        _R,
        "shoal serves text-only models",
        ("--limit-mm-per-prompt", '{"image": 2}'),
    ),
    VllmFlag(
        ("--enable-sleep-mode",),
        _R,
        "engines do not sleep; free their devices with `shoal scale` or `shoal stop`",
        ("--enable-sleep-mode",),
    ),
)


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
            self.refuse(parser, f"{option_string} {values} (only {self.default})")
        setattr(namespace, self.dest, values)


def add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    """The table's ACCEPTED, ONLY and REFUSED flags (SERVED ones belong to their features)."""
    for flag in VLLM_SERVE_FLAGS:
        if flag.verdict == Verdict.ACCEPTED:
            if flag.value is None:
                parser.add_argument(*flag.names, action="store_true", help=flag.line)
            else:
                kind = type(flag.value)
                parser.add_argument(*flag.names, type=kind, default=flag.value, help=flag.line)
        elif flag.verdict == Verdict.ONLY:
            parser.add_argument(
                *flag.names,
                type=type(flag.value),
                default=flag.value,
                action=_Only,
                reason=flag.line,
                help=f"only {flag.value}: {flag.line}",
            )
        elif flag.verdict == Verdict.REFUSED:
            parser.add_argument(
                *flag.names, action=_Refuse, reason=flag.line, help=f"refused: {flag.line}"
            )
