"""What a person waiting on a `shoal` command sees: INFO logs on stderr (stdout carries only
what a command prints, such as `--json` documents), one line per step, with the time.
"""

from __future__ import annotations

import logging
import sys


def configure_logging() -> None:
    """INFO logs on stderr, each with its time, level and logger."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
