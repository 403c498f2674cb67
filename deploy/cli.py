"""The `shoal` command: serve a cluster, drive it, resize it, drain a rank, show its status,
stop it, run the demo, or name the demo's model.

    shoal serve PATH --data-parallel-size N [--namespace NAME] [--port P] [engine flags]
    shoal api-server --namespace NAME [--port P] [--ready-timeout S] [--exit-with-cluster]
    shoal generate [--namespace NAME] [--chat] [--max-tokens N] PROMPT [PROMPT ...]
    shoal scale --namespace NAME --data-parallel-size M [--switch-timeout-s S] [--json]
    shoal drain --namespace NAME (--rank R | --node-ip IP) [--deadline-s S] [--no-restart]
    shoal status [--namespace NAME] [--json]
    shoal stop [--namespace NAME] [--timeout S]
    shoal demo [--data-parallel-size N]
    shoal models

Every subcommand that talks to a cluster reaches Ray at --address (default "auto":
RAY_ADDRESS or the local node). A subcommand's module is imported only when it runs (or its
help is shown), so a quick one does not wait for the others' imports (torch, the HTTP stack).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.deploy.flags import HelpFormatter
from shoal.deploy.progress import configure_logging


@dataclass(frozen=True)
class _Command:
    """One subcommand: its help line, and where its flags and its run function live."""

    help: str
    module: str
    add_args: str
    run: str

    def function(self, name: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), name)


COMMANDS: dict[str, _Command] = {
    "serve": _Command(
        "launch a cluster and serve until stopped", "shoal.deploy.serve", "add_serve_args", "run"
    ),
    "api-server": _Command(
        "serve the OpenAI API of a running cluster (attach by namespace)",
        "shoal.deploy.openai.server",
        "add_api_server_args",
        "run",
    ),
    "status": _Command(
        "ranks, their load, and attached clients", "shoal.deploy.status", "add_status_args", "run"
    ),
    "scale": _Command(
        "resize a running cluster while it serves", "shoal.deploy.scale", "add_scale_args", "run"
    ),
    "drain": _Command(
        "a rank stops taking work, finishes or hands over its own, restarts",
        "shoal.deploy.drain",
        "add_drain_args",
        "run_command",
    ),
    "stop": _Command("tear the cluster down", "shoal.deploy.stop", "add_stop_args", "run"),
    "generate": _Command(
        "stream prompts through a running cluster",
        "shoal.deploy.generate",
        "add_generate_args",
        "run",
    ),
    "demo": _Command(
        "a local two-rank cluster of SmolLM2", "shoal.deploy.demo", "add_demo_args", "run"
    ),
    "models": _Command(
        "print the path of the demo's model (SmolLM2-135M-Instruct, GGUF)",
        "shoal.deploy.models",
        "add_models_args",
        "run",
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `shoal` parser with every subcommand's flags, or only those of `only` ("": none)."""
    parser = argparse.ArgumentParser(prog="shoal", description="LLM serving on a Ray cluster.")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_SubcommandParser
    )
    for name, command in COMMANDS.items():
        subparser = commands.add_parser(name, help=command.help)
        if only is None or only == name:
            command.function(command.add_args)(subparser)
    return parser


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its `--help` shows every flag's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shoal` console script. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The subcommand is the first word that is not a flag (`shoal --help` has none).
    named = next((word for word in argv if not word.startswith("-")), None)
    args = build_parser(named if named in COMMANDS else "").parse_args(argv)
    configure_logging()
    command = COMMANDS[args.command]
    return int(command.function(command.run)(args))


if __name__ == "__main__":
    sys.exit(main())
