"""The fenced code blocks of a Markdown file, each with the line it starts at and whether it is
marked not to run.

A block that must not run in CI (it needs a GPU, a Kubernetes cluster, a remote Ray head, or
is not a command at all) is preceded, on the line just above its opening fence, by

    <!-- readme: no-run (why) -->

with a reason in the parentheses. Any other line that starts with `<!-- readme:` is a mistake
and is reported as one, so a misspelt marker cannot silently leave a block unmarked.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

# The languages the README test runs; any other block must be marked no-run.
RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!-- readme: no-run \((?P<why>[^()]*\S[^()]*)\) -->\s*$")
_ANY_MARKER = re.compile(r"^\s*<!--\s*readme\b")


class ReadmeFormatError(ValueError):
    """A fence that is never closed, or a `<!-- readme: ... -->` line that is not the marker."""


@dataclass(frozen=True)
class Block:
    """One fenced code block.

    Attributes:
        line: the 1-based line of its opening fence.
        language: the info string's first word, lower-cased ("" when none).
        code: its lines, with the fence's indentation removed.
        no_run: the reason of the no-run marker above it, or None.
    """

    line: int
    language: str
    code: str
    no_run: str | None = None

    @property
    def kind(self) -> str | None:
        """How the README test runs it ("bash" or "python"), or None if it cannot."""
        return RUNNABLE.get(self.language)

    @property
    def where(self) -> str:
        """Where a reader finds it: `README.md:58 (bash)`."""
        return f"line {self.line} ({self.language or 'no language'})"


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced code block of `text`, in order.

    Raises:
        ReadmeFormatError: a fence is not closed, or a `<!-- readme:` line is malformed.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if _ANY_MARKER.match(line) and not _MARKER.match(line):
            raise ReadmeFormatError(
                f"line {index + 1}: {line.strip()!r} is not `<!-- readme: no-run (why) -->`"
            )
        opening = _FENCE.match(line)
        if opening is None:
            index += 1
            continue
        end = _closing_fence(lines, index, opening.group("fence"))
        indent = len(opening.group("indent"))
        body = "\n".join(body_line[indent:] if body_line[:indent].isspace() else body_line
                         for body_line in lines[index + 1 : end])  # fmt: skip
        marker = _MARKER.match(lines[index - 1]) if index > 0 else None
        info = opening.group("info").strip()
        blocks.append(
            Block(
                line=index + 1,
                language=info.split()[0].lower() if info else "",
                code=textwrap.dedent(body) + "\n",
                no_run=marker.group("why").strip() if marker else None,
            )
        )
        index = end + 1
    return blocks


def _closing_fence(lines: list[str], opening: int, fence: str) -> int:
    """The index of the line that closes the fence opened at `opening`."""
    for index in range(opening + 1, len(lines)):
        stripped = lines[index].strip()
        if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
            return index
    raise ReadmeFormatError(f"line {opening + 1}: the code block opened here is never closed")
