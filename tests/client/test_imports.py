"""What importing the clients costs: no torch unless a model runs in this process."""

from __future__ import annotations

import subprocess
import sys

from tests.ray_utils import REPO_ROOT


def _modules_after(code: str) -> set[str]:
    script = f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


def test_the_clients_import_without_torch() -> None:
    loaded = _modules_after(
        "import shoal.client, shoal.client.api.async_llm, shoal.client.routing.lb_client\n"
        "from shoal import AsyncLLM, SamplingParams"
    )
    assert "shoal.client.api.async_llm" in loaded
    assert "torch" not in loaded


def test_the_offline_llm_brings_torch_when_used() -> None:
    assert "torch" in _modules_after("from shoal import LLM")
