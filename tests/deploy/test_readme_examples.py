"""The README's OpenAI API examples, run as pasted against a real front end: every curl command
and every Python snippet of the section that talks to `127.0.0.1:8000`, so the README cannot
drift from the server.

One server: the front end's app over one engine process of a tiny Llama (no Ray: the examples
exercise the HTTP API, which is the same over a cluster), with the names the README uses:
the model `llama` and an API key, in `$KEY` (shell) and `KEY` (Python). Only the address is
changed, to the test server's free port. The resize command is not run: it needs a cluster
and starts three more ranks (`test_elastic_doors.py` runs that door).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
from collections.abc import Iterator

import pytest

from tests.deploy.inproc_server import serving_in_process
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import REPO_ROOT

README = REPO_ROOT / "README.md"
SECTION = "## The OpenAI API"
ADDRESS = "127.0.0.1:8000"
KEY = "readme-key"
# Commands not run, each with why (see the module docstring).
NOT_RUN = ("/scale_elastic_ep -H",)


def readme_examples() -> list[tuple[str, str]]:
    """(language, code) of each fenced bash or python block of the README's OpenAI API
    section that talks to a server at `ADDRESS`."""
    text = README.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    blocks = re.findall(r"^```(bash|python)\n(.*?)^```", text[start:end], re.S | re.M)
    return [(language, code) for language, code in blocks if ADDRESS in code]


def shell_commands(block: str) -> list[str]:
    """The commands of a shell block, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip()]


def test_the_examples_are_found() -> None:
    examples = readme_examples()
    assert [language for language, _ in examples] == ["bash", "python", "python"]
    commands = shell_commands(examples[0][1])
    assert len(commands) == 5 and all(c.startswith("curl ") for c in commands)
    assert sum(any(skip in c for skip in NOT_RUN) for c in commands) == 1


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's address, HOST:PORT."""
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("readme"), "llama")
    with serving_in_process(checkpoint, model_name="llama", api_key=KEY) as url:
        yield url.removeprefix("http://")


@pytest.mark.slow
def test_the_curl_examples_run_as_pasted(served: str) -> None:
    """Each command runs in bash with `curl` failing on an HTTP error (`--fail-with-body`)."""
    address = served
    fail_on_http_errors = 'curl() { command curl --fail-with-body -sS --max-time 120 "$@"; }'
    outputs: dict[str, str] = {}
    for command in shell_commands(readme_examples()[0][1]):
        if any(skip in command for skip in NOT_RUN):
            continue
        script = f"set -euo pipefail\n{fail_on_http_errors}\n{command.replace(ADDRESS, address)}"
        done = subprocess.run(
            ["bash", "-c", script],
            capture_output=True, text=True, timeout=180, env={**os.environ, "KEY": KEY},
        )  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
        path = re.search(rf"{ADDRESS}(/\S*)", command)
        assert path is not None
        outputs[path.group(1)] = done.stdout
    assert '"text_completion"' in outputs["/v1/completions"]
    assert outputs["/v1/chat/completions"].rstrip().endswith("data: [DONE]")
    served_requests = r'^vllm:request_success_total\{.*model_name="llama"'
    assert re.search(served_requests, outputs["/metrics"], re.M), outputs["/metrics"]
    assert '"is_scaling_elastic_ep":false' in outputs["/is_scaling_elastic_ep"]


@pytest.mark.slow
def test_the_python_examples_run_as_pasted(served: str) -> None:
    address = served
    printed = io.StringIO()
    namespaces = []
    for _, code in readme_examples()[1:]:
        namespace: dict[str, object] = {"KEY": KEY, "__name__": "readme_example"}
        with contextlib.redirect_stdout(printed):
            exec(compile(code.replace(ADDRESS, address), "README.md", "exec"), namespace)
        namespaces.append(namespace)
    lines = printed.getvalue().splitlines()
    # The completion, a delta per streamed chunk of two choices, and the usage at the end.
    assert len(lines) > 3 and "completion_tokens=" in lines[-1], lines
    response = namespaces[1]["response"]
    assert response.choices[0].finish_reason in ("stop", "length")  # type: ignore[attr-defined]
    assert namespaces[1]["params"].structured_outputs.regex == r"\d+"  # type: ignore[attr-defined]
