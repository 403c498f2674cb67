"""The README test's own parts, on small Markdown texts: finding blocks and their markers, and
the terminal that carries a shell's state from block to block and names README lines."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ray_utils import free_port
from tests.readme.blocks import Block, ReadmeFormatError, fenced_blocks
from tests.readme.terminal import ReadmeTerminal

MARKDOWN = """\
# Title

```bash
echo one
```

<!-- readme: no-run (needs a GPU) -->
```python
import torch
```

1. A step:
   ```sh
   echo nested
   ```

```
a file tree
```
"""


def test_blocks_carry_their_line_language_and_marker() -> None:
    blocks = fenced_blocks(MARKDOWN)
    assert [(b.line, b.language, b.no_run) for b in blocks] == [
        (3, "bash", None),
        (8, "python", "needs a GPU"),
        (13, "sh", None),
        (17, "", None),
    ]
    assert blocks[2].code == "echo nested\n" and blocks[2].kind == "bash"
    assert blocks[3].kind is None  # the README test refuses it unless it is marked


@pytest.mark.parametrize(
    "marker",
    ["<!-- readme: norun (why) -->", "<!-- readme: no-run -->", "<!-- readme: no-run () -->"],
)
def test_a_misspelt_marker_names_its_line(marker: str) -> None:
    with pytest.raises(ReadmeFormatError, match=r"^line 2: "):
        fenced_blocks(f"text\n{marker}\n```bash\necho\n```\n")


def test_an_unclosed_block_names_its_line() -> None:
    with pytest.raises(ReadmeFormatError, match=r"^line 3: .* never closed"):
        fenced_blocks("a\n\n```bash\necho\n")


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[ReadmeTerminal]:
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"}
    term = ReadmeTerminal(tmp_path / "term", tmp_path, env, ports={8000: free_port()})
    try:
        yield term
    finally:
        term.close()


def _block(code: str, language: str = "bash", line: int = 10) -> Block:
    return Block(line=line, language=language, code=code)


def test_a_shells_state_carries_to_the_next_block(terminal: ReadmeTerminal) -> None:
    first = "export SHARED=exported\nPLAIN=plain\ngreet() { echo hi; }\nmkdir -p sub && cd sub\n"
    assert terminal.run(_block(first), 30).ok
    second = terminal.run(_block('echo "$SHARED $PLAIN $(greet) $(basename "$PWD")"\n'), 30)
    assert second.ok and second.output.strip() == "exported plain hi sub", second.output
    # A python block sees what was exported, and runs where the shell is.
    code = "import os\nprint(os.environ['SHARED'], os.path.basename(os.getcwd()))\n"
    third = terminal.run(_block(code, "python"), 60)
    assert third.ok and third.stdout.strip() == "exported sub", third.output


def test_errors_name_the_readme_line(terminal: ReadmeTerminal) -> None:
    failed = terminal.run(_block("true\necho $UNDEFINED\n", line=40), 30)
    assert not failed.ok and "README.md:42: UNDEFINED: unbound variable" in failed.output
    raised = terminal.run(_block("x = 1\nraise SystemExit(f'bad {x}')\n", "python", 50), 60)
    assert not raised.ok and "bad 1" in raised.output
    traceback = terminal.run(_block("\n\n1 / 0\n", "python", 60), 60)
    assert 'File "README.md", line 63' in traceback.output, traceback.output
    report = terminal.report(traceback, "failed")
    assert report.startswith("README.md line 60 (python): failed (exit status 1)")
    assert "earlier blocks failed too: line 40 (bash), line 50 (python)" in report


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/ok" else 404)
        self.end_headers()
        self.wfile.write(b"body of " + self.path.encode())

    def log_message(self, *args: object) -> None:
        pass


def test_curl_fails_on_an_http_error_and_ports_are_replaced(terminal: ReadmeTerminal) -> None:
    port = terminal.ports[8000]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ok = terminal.run(_block("curl -sS http://127.0.0.1:8000/ok\n"), 30)
        assert ok.ok and ok.output == "body of /ok", ok.output
        missing = terminal.run(_block("curl -sS http://localhost:8000/missing\n"), 30)
        assert not missing.ok and "body of /missing" in missing.output
        asked = terminal.run(_block("curl -sf http://127.0.0.1:8000/missing || echo refused\n"), 30)
        assert asked.ok and asked.output.strip() == "refused", asked.output
    finally:
        server.shutdown()
        server.server_close()


def test_background_processes_outlive_their_block_until_close(tmp_path: Path) -> None:
    term = ReadmeTerminal(tmp_path / "term", tmp_path, {"PATH": os.environ["PATH"]})
    started = term.run(_block("sleep 600 &\necho $! > pid\n"), 30)
    assert started.ok
    pid = int((tmp_path / "pid").read_text())
    os.kill(pid, 0)  # still running after its block
    term.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
