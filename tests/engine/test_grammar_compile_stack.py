"""The engine compiles grammars on a deep stack: a `$ref` chain that overflows an 8 MiB thread
(and kills its process) compiles in the engine. Each compile runs in a child interpreter, so a
crash fails the test rather than ending the test run."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.factories import make_tokenizer_json

# Past the ~930 links an 8 MiB stack holds, within the engine's 64 MiB.
LENGTH = 1_500

_COMPILE = """
import sys
import threading

from shoal.engine.protocol import StructuredOutputsParams
from shoal.engine.structured_output import GrammarCompiler, grammar_text
from tests.security.poison_inputs import ref_chain_schema

compiler = GrammarCompiler(open(sys.argv[1]).read(), 512, [0])
params = StructuredOutputsParams(json=ref_chain_schema(int(sys.argv[2])))
if sys.argv[3] == "engine":
    print("compiled", compiler.compile(params).error)
else:  # the same compile on an ordinary 8 MiB thread
    threading.stack_size(8 << 20)
    thread = threading.Thread(target=compiler._matcher, args=(grammar_text(params),))
    thread.start()
    thread.join()
    print("compiled")
"""


def _compile(tmp_path: Path, where: str) -> subprocess.CompletedProcess[str]:
    make_tokenizer_json(tmp_path)
    root = Path(__file__).resolve().parents[2]
    script = textwrap.dedent(_COMPILE)
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "tokenizer.json"), str(LENGTH), where],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )


@pytest.mark.slow
def test_a_chain_that_overflows_an_ordinary_stack_compiles_in_the_engine(tmp_path: Path) -> None:
    ordinary = _compile(tmp_path, "ordinary")
    assert ordinary.returncode == -signal.SIGSEGV, ordinary.stderr[-2000:]
    engine = _compile(tmp_path, "engine")
    assert engine.returncode == 0, engine.stderr[-2000:]
    assert engine.stdout.strip() == "compiled None"
