"""Loading progress: how many tensors a checkpoint holds (from its headers), and the log
records `with_progress` makes as a load goes, each carrying its `LoadProgress`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shoal.engine.loader import load_weights, num_weights
from shoal.engine.loader.progress import LoadProgress, with_progress
from tests.factories import make_tiny_checkpoint, make_tiny_gguf


@pytest.mark.parametrize("sharded", [False, True])
def test_num_weights_counts_what_a_safetensors_checkpoint_yields(
    tmp_path: Path, sharded: bool
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path, "llama", sharded=sharded)
    assert num_weights(checkpoint) == sum(1 for _ in load_weights(checkpoint)) > 0


def test_num_weights_counts_a_gguf_files_tensors(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "hf", "llama")
    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint)
    assert num_weights(gguf) == sum(1 for _ in load_weights(gguf))


def test_num_weights_of_something_unreadable_is_zero(tmp_path: Path) -> None:
    assert num_weights(str(tmp_path / "missing")) == 0
    (tmp_path / "config.json").write_text("{}")
    assert num_weights(str(tmp_path)) == 0  # no weights: the load itself says so


def _records(caplog: pytest.LogCaptureFixture) -> list[LoadProgress]:
    return [r.load_progress for r in caplog.records if hasattr(r, "load_progress")]


def test_a_load_logs_its_start_each_tenth_and_its_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shoal.engine.loader.progress")
    assert list(with_progress(range(25), 25)) == list(range(25))
    progress = _records(caplog)
    assert [p.done for p in progress] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25]
    assert all(p.total == 25 for p in progress)
    assert progress[5].describe().startswith("loading weights 40% (10 of 25 tensors, ")
    assert progress[-1].describe().startswith("loaded weights: 25 tensors in ")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [p.describe() for p in progress]


def test_a_load_of_unknown_size_logs_its_start_and_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shoal.engine.loader.progress")
    assert list(with_progress(iter("abc"), 0)) == ["a", "b", "c"]
    progress = _records(caplog)
    assert [(p.done, p.total) for p in progress] == [(0, 0), (3, 3)]
    assert progress[0].describe().startswith("loading weights (0 tensors so far, ")
    assert progress[1].describe().startswith("loaded weights: 3 tensors in ")
    blocks = LoadProgress(4, 0, 1.3, "GGUF blocks", "projections")
    assert blocks.describe() == "loading GGUF blocks (4 projections so far, 1.3 s)"
