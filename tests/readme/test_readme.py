"""README.md as a contract: every fenced code block runs as pasted, in order, in one terminal
(`tests/readme/terminal.py` says what that terminal is), or is marked
`<!-- readme: no-run (why) -->` on the line above it.

The terminal starts at the repository root with the environment of a reader who has Ray
running: `RAY_ADDRESS` names a Ray head this test starts on free ports (the README's own
`ray start --head` is marked no-run: it would take the machine's default port), with Ray's
token auth off as that head has it. `.venv/bin` is not on the PATH until a block puts it there.
Built CPU kernels are found where this machine keeps them (`SHOAL_KERNEL_CACHE`), as they
would be on a reader's machine after the first run. Blocks that need a server follow the block
that starts it, as a reader would run them; one cluster serves many blocks.

A block fails the test when it exits non-zero or times out; a python block also when it prints
nothing (an example that prints nothing shows its reader nothing). The failure names the
README line and shows what the block printed.

Where a new block goes: one that talks to the OpenAI server (`127.0.0.1:8000`, `$KEY`, model
`llama`) belongs in "The OpenAI API", after the block that starts the server and before the
`shoal stop --namespace prod` that ends that section; one that needs a cluster by namespace,
between `shoal serve ... --detached` and the `shoal stop` after it in "Using it". `$MODEL` is
the demo model everywhere after the first block of "Using it".
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.engine.kernels.paged_attention import CACHE_ENV, kernel_cache_dir
from tests.ray_utils import REPO_ROOT, free_port, start_ray_head, stop_ray_head
from tests.readme.blocks import Block, fenced_blocks
from tests.readme.terminal import README_PORTS, ReadmeTerminal

README = REPO_ROOT / "README.md"
BLOCKS = fenced_blocks(README.read_text())
RUN = [block for block in BLOCKS if block.no_run is None and block.kind is not None]
# Per block: `bin/demo` starts Ray and two ranks, a serve block waits for its cluster.
BLOCK_TIMEOUT_S = 600.0


def test_every_block_runs_or_says_why_not() -> None:
    unmarked = [block.where for block in BLOCKS if block.no_run is None and block.kind is None]
    assert not unmarked, (
        f"README.md blocks the test cannot run: {', '.join(unmarked)}. Give each a language it "
        "runs (bash, sh, python), or put `<!-- readme: no-run (why) -->` on the line above it."
    )
    assert RUN, "no README block to run"


def _terminal_env(ray_address: str) -> dict[str, str]:
    """This process's environment as a fresh terminal's: no virtualenv active, no Ray address
    but the test's head."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VIRTUAL_ENV"))}
    env.pop("PYTHONPATH", None)
    venv_bins = {str(REPO_ROOT / ".venv" / "bin"), str(Path(sys.executable).parent)}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p not in venv_bins
    )
    env.update(
        RAY_ADDRESS=ray_address,
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
    )
    env[CACHE_ENV] = str(kernel_cache_dir())
    return env


@pytest.fixture(scope="module")
def terminal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadmeTerminal]:
    head = start_ray_head(num_cpus=6)
    ports = {port: free_port() for port in README_PORTS}
    term = ReadmeTerminal(
        tmp_path_factory.mktemp("readme"), REPO_ROOT, _terminal_env(head.gcs_address), ports
    )
    try:
        yield term
    finally:
        term.close()
        stop_ray_head(head)


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 120)
@pytest.mark.parametrize("block", RUN, ids=lambda block: f"line{block.line}-{block.kind}")
def test_block_runs_as_pasted(block: Block, terminal: ReadmeTerminal) -> None:
    result = terminal.run(block, BLOCK_TIMEOUT_S)
    assert result.ok, terminal.report(result, "failed")
    if block.kind == "python":
        assert result.stdout.strip(), terminal.report(result, "printed nothing")


def test_bin_demo_says_what_it_does_from_its_first_line(terminal: ReadmeTerminal) -> None:
    """The demo block as it ran above: its first line is the setup's, printed before Python
    starts; then each rank's start with its weights in percent, the ranks serving, and the
    answers."""
    demo = next(block for block in RUN if block.code.startswith("bin/demo"))
    if demo.line not in terminal.runs:
        pytest.skip("the demo block did not run in this session (run the whole module)")
    lines = terminal.runs[demo.line].read_text(errors="replace").splitlines()
    assert lines[0].startswith("bin/setup: "), lines[:3]
    assert lines[1].startswith("bin/demo: starting"), lines[:3]

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    for rank in (0, 1):
        assert first(rf"rank {rank}: loading weights 0% ") < first(rf"rank {rank}: loaded weights")
        assert first(rf"rank {rank}: loaded weights") < first(rf"rank {rank} serves")
        assert first(rf"rank {rank} serves") < first(r"^cluster ready in ")
    assert first(r"^cluster ready in ") < first(r"^requests per rank: ")
