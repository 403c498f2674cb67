"""`TensorParallel`'s shards: equal blocks, padded vocabulary blocks, KV heads split or shared;
and `LazyTensor`, which reads only a shard's block of a stored tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shoal.engine.loader import LazyTensor, load_lazy_weights, load_weights
from shoal.engine.loader.safetensors_loader import iter_lazy_safetensors_weights
from shoal.engine.parallel.tensor_parallel import Shard, TensorParallel
from tests.factories import Arch, make_tiny_checkpoint


def _workers(size: int) -> list[TensorParallel]:
    # Shard arithmetic needs no group: a stand-in object marks the groups as present.
    return [TensorParallel(rank, size, groups=object()) for rank in range(size)]  # type: ignore[arg-type]


def test_vocabulary_blocks_are_padded_to_one_size_and_cover_the_vocabulary_once() -> None:
    for vocab, size in ((100, 2), (101, 2), (10, 4), (5, 4)):
        shards = [w.vocab_shard(vocab) for w in _workers(size)]
        padded = {p for _, p in shards}
        assert padded == {-(-vocab // size)}
        rows = [r for shard, _ in shards for r in range(shard.start, shard.stop)]
        assert rows == list(range(vocab))
        # Worker r's block starts at r * padded: the gathered logits are in vocabulary order.
        for rank, (shard, p) in enumerate(shards):
            assert shard.size == 0 or shard.start == rank * p


def test_kv_heads_are_split_or_each_worker_holds_the_one_its_queries_read() -> None:
    assert [w.kv_head_shard(8) for w in _workers(4)] == [Shard(2 * r, 2) for r in range(4)]
    # 2 KV heads, 4 workers of 2 query heads each (8 heads, 4 per KV head).
    assert [w.kv_head_shard(2) for w in _workers(4)] == [Shard(h, 1) for h in (0, 0, 1, 1)]
    assert [w.kv_head_shard(1) for w in _workers(2)] == [Shard(0, 1), Shard(0, 1)]


def test_a_lazy_tensor_reads_only_the_block_asked_for(tmp_path: Path) -> None:
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    [(name, lazy)] = [(n, (t.shape, t.read_block(0, 2, 3), t.read_block(1, 4, 4)))
                      for n, t in iter_lazy_safetensors_weights(tmp_path)]  # fmt: skip
    shape, rows, columns = lazy
    assert (name, shape) == ("w", (6, 8))
    torch.testing.assert_close(rows, full[2:5], rtol=0, atol=0)
    torch.testing.assert_close(columns, full[:, 4:], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_checkpoints_lazy_weights_match_its_eager_ones(tmp_path: Path, arch: Arch) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, sharded=True)
    eager = dict(load_weights(path))
    for name, lazy in load_lazy_weights(path):
        assert isinstance(lazy, LazyTensor)
        torch.testing.assert_close(lazy.read(), eager[name], rtol=0, atol=0)
