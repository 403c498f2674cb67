"""Fixtures shared by the front end's tests: one in-process OpenAI server per session."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.deploy.inproc_server import serving_tiny_with_tools


@pytest.fixture(scope="session")
def inproc_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a tiny model's front end (no Ray): tools rendered, `auto` parsed."""
    with serving_tiny_with_tools(tmp_path_factory.mktemp("tiny-tools")) as url:
        yield url


@pytest.fixture
def inproc_client(inproc_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{inproc_url}/v1", api_key="unused", max_retries=0)
