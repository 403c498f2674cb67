"""One terminal that a reader pastes the README's code blocks into, in order.

A bash block runs in bash as the reader's shell would run it; a python block is saved to a
file and run by that shell's `python` (the one `source .venv/bin/activate` put first on the
PATH), as a reader runs a script. What a shell keeps between two pastes carries from one block
to the next: variables (exported or not), functions, the working directory, and processes
started in the background with `&`, which run on until the terminal closes.

What differs from a reader's terminal, and why:
- each block runs with `set -euo pipefail`, so a failing command or an undefined variable fails
  the block (a reader would see the error and stop);
- `curl` fails on an HTTP error status (`--fail-with-body`, unless the command asks for `-f`);
- ports 8000 and 8001 of `127.0.0.1`, `localhost` and `--port` become free ports (another
  process on the machine may hold the usual ones);
- `$HOME` is a fresh directory (files a block creates there stay in the test), and the
  environment is the one `ReadmeTerminal` is given (see tests/readme/test_readme.py).

Errors name README lines: a shell error at line 3 of the block that opens at line 58 reads
`README.md:61`, as does a Python traceback's line.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.readme.blocks import Block

# The ports the README's examples use, replaced by free ones.
README_PORTS = (8000, 8001)
# How long background processes get to end on SIGTERM before SIGKILL, when the terminal closes.
_CLOSE_GRACE_S = 60.0

# Runs one block: the state of the blocks before it, the block, then its state saved.
_WRAPPER = r"""
__readme_base=" $(compgen -v | tr '\n' ' ') "
set -euo pipefail
if [ -f {state} ]; then source {state}; fi
curl() {{
  local arg
  for arg in "$@"; do
    case "$arg" in --fail|--fail-with-body|-[a-zA-Z]*f*) command curl "$@"; return;; esac
  done
  command curl --fail-with-body "$@"
}}
__readme_save() {{
  {{
    export -p
    local name
    for name in $(compgen -v); do
      case "$__readme_base" in *" $name "*) continue;; esac
      case "$name" in __readme_*|name) continue;; esac
      declare -p "$name" 2>/dev/null || true
    done
    for name in $(compgen -A function); do
      case "$name" in curl|__readme_*) continue;; esac
      declare -f "$name"
    done
    printf 'cd %q\n' "$PWD"
  }} > {state}.new && mv {state}.new {state}
}}
trap __readme_save EXIT
{command}
"""


@dataclass
class BlockRun:
    """How one block ran: its exit status and what it printed (stdout and stderr, in order;
    a python block's stdout also on its own)."""

    block: Block
    returncode: int
    output: str
    stdout: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class ReadmeTerminal:
    """Runs README blocks one after the other in one simulated terminal.

    Args:
        workdir: a fresh directory for the terminal's files (scripts, logs, its $HOME).
        cwd: where the terminal starts (the repository root, as after `git clone; cd`).
        env: the environment the terminal starts with ($HOME is set to `workdir/home`).
        ports: README port → the free port used instead (default: `README_PORTS` unchanged).
    """

    def __init__(
        self, workdir: Path, cwd: Path, env: dict[str, str], ports: dict[int, int] | None = None
    ) -> None:
        self.workdir = workdir
        self.home = workdir / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = {**env, "HOME": str(self.home)}
        self.ports = ports or {}
        self._state = workdir / "state.sh"
        self._state.write_text(f"cd {_quote(str(cwd))}\n")
        # Process groups of the blocks run so far: their background processes live on in them.
        self._groups: list[tuple[Block, int, Path]] = []
        # The log of each block run so far, by its line.
        self.runs: dict[int, Path] = {}
        self.failed: list[Block] = []

    def localise(self, code: str) -> str:
        """The block with the README's ports replaced by this terminal's."""
        for readme_port, port in self.ports.items():
            code = re.sub(
                rf"((?:127\.0\.0\.1|localhost):|--port[ =]){readme_port}\b", rf"\g<1>{port}", code
            )
        return code

    def run(self, block: Block, timeout_s: float) -> BlockRun:
        """Runs `block` (its kind must be bash or python) and returns how it went."""
        assert block.kind is not None, f"{block.where} is not a block this terminal runs"
        stem = f"readme-line-{block.line}"
        stdout_file = self.workdir / f"{stem}.stdout"
        if block.kind == "bash":
            script = self.workdir / f"{stem}.sh"
            script.write_text(self.localise(block.code))
            command = f"source {_quote(str(script))}"
        else:
            script = self.workdir / f"{stem.replace('-', '_')}.py"
            script.write_text(self.localise(block.code))
            command = f"python -u {_quote(str(script))} | tee {_quote(str(stdout_file))}"
        log = self.workdir / f"{stem}.log"
        wrapper = _WRAPPER.format(state=_quote(str(self._state)), command=command)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", wrapper],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its background processes stay in its group
            )
        self._groups.append((block, proc.pid, log))
        self.runs[block.line] = log
        timed_out = False
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out, returncode = True, -1
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        stdout = stdout_file.read_text(errors="replace") if stdout_file.exists() else ""
        result = BlockRun(block, returncode, self._readme_lines(log.read_text(errors="replace")),
                          stdout, timed_out)  # fmt: skip
        if not result.ok:
            self.failed.append(block)
        return result

    def report(self, result: BlockRun, problem: str) -> str:
        """A failure message: where the block is, what went wrong, what it printed, and what
        the background processes of earlier blocks printed last."""
        block = result.block
        status = "timed out" if result.timed_out else f"exit status {result.returncode}"
        lines = [
            f"README.md {block.where}: {problem} ({status})",
            "--- the block (as run) ---",
            self.localise(block.code).rstrip(),
            "--- what it printed ---",
            _tail(result.output, 80),
        ]
        earlier = [b.where for b in self.failed if b is not block]
        if earlier:
            lines.append(f"(earlier blocks failed too: {', '.join(earlier)})")
        for other, _, log in self._groups:
            if other is not block and _has_live_processes(self._group_of(other)):
                lines += [f"--- still running from {other.where}, last lines ---", _tail(
                    self._readme_lines(log.read_text(errors="replace")), 30)]  # fmt: skip
        return "\n".join(lines)

    def close(self) -> None:
        """Ends what the blocks left running: SIGTERM to each group, SIGKILL after a grace."""
        groups = [pid for _, pid, _ in self._groups]
        for pid in groups:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + _CLOSE_GRACE_S
        while time.monotonic() < deadline and any(_has_live_processes(g) for g in groups):
            time.sleep(0.5)
        for pid in groups:
            _signal_group(pid, signal.SIGKILL)

    def _group_of(self, block: Block) -> int:
        return next(pid for other, pid, _ in self._groups if other is block)

    def _readme_lines(self, text: str) -> str:
        """`readme-line-58.sh: line 3` → `README.md:61`; the same for Python tracebacks."""
        text = re.sub(
            r"\S*readme-line-(\d+)\.sh: line (\d+)",
            lambda m: f"README.md:{int(m[1]) + int(m[2])}",
            text,
        )
        return re.sub(
            r'File "\S*readme_line_(\d+)\.py", line (\d+)',
            lambda m: f'File "README.md", line {int(m[1]) + int(m[2])}',
            text,
        )


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _tail(text: str, num_lines: int) -> str:
    lines = text.rstrip().splitlines()
    cut = len(lines) - num_lines
    return "\n".join(([f"[... {cut} lines before]"] if cut > 0 else []) + lines[-num_lines:])


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def _has_live_processes(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
