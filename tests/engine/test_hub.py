"""Models given as Hub ids (`shoal.engine.loader.hub`), downloaded from a local mirror of the
Hub (`tests.hub_mirror`, where `HF_ENDPOINT` points): revisions, the download folder, the
errors, and the engine, `LLM` and `shoal serve` taking an id."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.client.api.llm import LLM
from shoal.deploy import cli
from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.hub import _download, is_hub_id, resolve_model
from shoal.engine.protocol import SamplingParams
from tests.factories import make_tiny_checkpoint
from tests.hub_mirror import HubMirror, serving_hub
from tests.ray_utils import free_port

REPO = "shoal-test/tiny-llama"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same weights twice, as `main` (context 512) and as the `short` branch (128)."""
    base = tmp_path_factory.mktemp("hub")
    return {
        "main": Path(make_tiny_checkpoint(base / "main", max_position_embeddings=512)),
        "short": Path(make_tiny_checkpoint(base / "short", max_position_embeddings=128)),
    }


@pytest.fixture
def hub(checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[HubMirror]:
    mirror = HubMirror({})
    for branch, folder in checkpoints.items():
        mirror.add(REPO, branch, folder)
    with serving_hub(mirror):
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        _download.cache_clear()  # each test resolves afresh
        yield mirror


def _max_position(folder: str) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"])


def _downloads(mirror: HubMirror) -> list[str]:
    return [path for method, path in mirror.requests if method == "GET" and "/resolve/" in path]


def test_an_id_is_downloaded_at_its_revision_and_found_again(
    hub: HubMirror, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    folder = resolve_model(REPO, None, str(tmp_path))
    assert Path(folder).is_relative_to(tmp_path) and _max_position(folder) == 512
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (Path(folder) / name).read_bytes() == (checkpoints["main"] / name).read_bytes()
    assert _max_position(resolve_model(REPO, "short", str(tmp_path))) == 128
    commit = hub.repos[REPO]["short"].commit
    assert resolve_model(REPO, commit, str(tmp_path)) == resolve_model(REPO, "short", str(tmp_path))
    num_downloads = len(_downloads(hub))
    _download.cache_clear()  # another process: one look-up of the revision, no file again
    assert resolve_model(REPO, None, str(tmp_path)) == folder
    assert len(_downloads(hub)) == num_downloads


def test_a_path_is_never_an_id(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path), "v1", None) == str(tmp_path)
    assert not is_hub_id("/models/llama") and not is_hub_id("../llama")
    assert is_hub_id("meta-llama/Llama-3.2-1B") and is_hub_id("gpt2")


def test_a_missing_repository_or_revision_or_hub_is_one_clear_error(
    hub: HubMirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelLoadError, match="neither a local path nor a repository"):
        resolve_model("shoal-test/missing", None, str(tmp_path))
    with pytest.raises(ModelLoadError, match="has no revision 'v9'"):
        resolve_model(REPO, "v9", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    with pytest.raises(ModelLoadError, match="not reachable and no snapshot"):
        resolve_model(REPO, None, str(tmp_path / "empty"))


def test_the_engine_and_llm_serve_an_id_as_its_local_copy(
    hub: HubMirror, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    kwargs = {"num_gpu_blocks_override": 32, "download_dir": str(tmp_path)}
    engine = EngineCore(EngineConfig.from_kwargs(REPO, revision="short", **kwargs))
    try:
        assert engine.max_model_len == 128  # the `short` branch's config
        assert Path(engine.config.model.model).is_relative_to(tmp_path)
    finally:
        engine.shutdown()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for model in (REPO, str(checkpoints["main"])):
        llm = LLM(model, **kwargs)
        try:
            outputs.append(llm.generate("the hub", params, use_tqdm=False)[0].outputs[0])
        finally:
            llm.shutdown()
    assert outputs[0].token_ids == outputs[1].token_ids and len(outputs[0].token_ids) == 6


def test_shoal_serve_refuses_an_unknown_id_in_one_line_before_ray(
    hub: HubMirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead_ray = f"127.0.0.1:{free_port()}"
    argv = ["serve", "shoal-test/missing", "--download-dir", str(tmp_path), "--address", dead_ray]
    with caplog.at_level(logging.ERROR):
        assert cli.main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "neither a local path nor a repository" in errors[0]
