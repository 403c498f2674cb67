"""Re-staging a rank's experts for a new placement: `ExpertParallel.stage` builds the new experts
beside the live ones (held ones copied, the others read from the checkpoint, only theirs), and
`commit` swaps them in and releases the old; a dropped stage changes nothing."""

from __future__ import annotations

import gc
import threading
import uuid
import weakref
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed import TCPStore

from shoal.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import SafetensorsReader, load_model_arch, load_weights
from shoal.engine.model import layers as model_layers
from shoal.engine.model.experts import RoutedExperts
from shoal.engine.model.layers import can_pack_weights, packed_linear
from shoal.engine.model.llama import DecoderLayer
from shoal.engine.model.mixtral import MixtralForCausalLM, MixtralMoE
from shoal.engine.model.model_runner import ModelRunner
from shoal.engine.parallel.distributed import ProcessGroups, Rendezvous
from shoal.engine.parallel.expert_parallel import ExpertParallel, ExpertPlacement
from tests.engine.model_utils import arch_from_hf, greedy_generate, make_hf_model
from tests.factories import make_tiny_checkpoint
from tests.tolerances import assert_reordered_close

NUM_EXPERTS = 8


@pytest.fixture(scope="module", params=[False, True], ids=["single-file", "sharded"])
def moe_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("moe"),
        "mixtral",
        num_experts=NUM_EXPERTS,
        seed=3,
        sharded=request.param,
    )


@pytest.fixture(scope="module")
def checkpoint(moe_path: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(moe_path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """Every (name, index) read through a `SafetensorsReader` during the test."""
    seen: list[tuple[str, int | None]] = []
    original = SafetensorsReader.get

    def get(self: SafetensorsReader, name: str, index: int | None = None) -> torch.Tensor:
        seen.append((name, index))
        return original(self, name, index)

    monkeypatch.setattr(SafetensorsReader, "get", get)
    return seen


def _model(path: str, placement: ExpertPlacement, rank: int) -> MixtralForCausalLM:
    model = MixtralForCausalLM(
        load_model_arch(path), expert_parallel=ExpertParallel(placement, rank)
    )
    model.load_weights(load_weights(path))
    return model


def _experts(model: MixtralForCausalLM) -> list[RoutedExperts]:
    return [cast(MixtralMoE, cast(DecoderLayer, layer).mlp).experts for layer in model.layers]


def _expected(checkpoint: dict[str, torch.Tensor], layer: int, expert: int) -> torch.Tensor:
    """An expert's checkpoint weights as one flat vector: gate, up, down."""
    base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    return torch.cat([checkpoint[f"{base}.{w}.weight"].flatten() for w in ("w1", "w3", "w2")])


def _held(experts: RoutedExperts, local: int) -> torch.Tensor:
    """The same flat vector from a layer's weights, dense or packed."""
    if experts.packed is None:
        return torch.cat([experts.w13[local].flatten(), experts.w2[local].flatten()])
    gate_up, down = experts.packed[local]
    # x @ W^T with x = I recovers W from its oneDNN layout.
    size, hidden = experts.intermediate_size, experts.hidden_size
    w13 = packed_linear(torch.eye(hidden), gate_up).T
    w2 = packed_linear(torch.eye(size), down).T
    return torch.cat([w13.flatten(), w2.flatten()])


def _assert_holds_checkpoint_experts(
    model: MixtralForCausalLM, checkpoint: dict[str, torch.Tensor], expert_ids: list[int]
) -> None:
    for layer, experts in enumerate(_experts(model)):
        assert experts.expert_ids == expert_ids
        for local, expert in enumerate(expert_ids):
            # Copies, and x @ W^T with x = I is exact: bit-equal.
            torch.testing.assert_close(
                _held(experts, local), _expected(checkpoint, layer, expert), rtol=0, atol=0
            )


def _expert_names(layers: int, expert_ids: list[int]) -> set[tuple[str, int | None]]:
    return {
        (f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight", None)
        for i in range(layers)
        for e in expert_ids
        for w in ("w1", "w2", "w3")
    }


@pytest.mark.parametrize(
    ("num_ranks", "rank"), [(4, 1), (1, 0), (4, 2)], ids=["4-ranks", "1-rank", "subset"]
)
def test_commit_holds_the_new_experts_reading_only_those_not_held(
    moe_path: str,
    checkpoint: dict[str, torch.Tensor],
    reads: list[tuple[str, int | None]],
    num_ranks: int,
    rank: int,
) -> None:
    old_ids = [4, 5, 6, 7]  # contiguous(8, 2), rank 1
    model = _model(moe_path, ExpertPlacement.contiguous(NUM_EXPERTS, 2), 1)
    ep = model.expert_parallel
    assert ep is not None
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, num_ranks)
    new_ids = placement.experts_of(rank)
    old_weights = [weakref.ref(e.w13) for e in _experts(model)]
    reads.clear()
    staged = ep.stage(placement, rank, moe_path)
    assert set(reads) == _expert_names(2, [e for e in new_ids if e not in old_ids])
    assert len(reads) == len(set(reads))
    ep.commit(staged)
    assert (ep.placement, ep.rank, ep.local_expert_ids) == (placement, rank, new_ids)
    _assert_holds_checkpoint_experts(model, checkpoint, new_ids)
    del staged
    gc.collect()
    assert all(ref() is None for ref in old_weights), "the old expert weights are still held"


def test_a_dropped_stage_leaves_the_layers_as_they_were(moe_path: str) -> None:
    model = _model(moe_path, ExpertPlacement.contiguous(NUM_EXPERTS, 2), 0)
    ep = model.expert_parallel
    assert ep is not None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    live = [e.w13 for e in _experts(model)]
    staged = ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 1), 0, moe_path)
    assert staged.layers[0].w13 is not None
    staged_ref = weakref.ref(staged.layers[0].w13)
    del staged
    gc.collect()
    assert staged_ref() is None, "a dropped stage's tensors are freed"
    assert ep.placement == ExpertPlacement.contiguous(NUM_EXPERTS, 2) and ep.rank == 0
    assert all(e.expert_ids == [0, 1, 2, 3] for e in _experts(model))
    assert all(e.w13 is w for e, w in zip(_experts(model), live, strict=True))
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.skipif(not can_pack_weights(torch.device("cpu"), torch.float32), reason="no oneDNN")
def test_packed_layers_share_held_experts_and_pack_the_new_ones(
    moe_path: str,
    checkpoint: dict[str, torch.Tensor],
    reads: list[tuple[str, int | None]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model_layers, "MIN_PACKED_WEIGHT_NUMEL", 0)  # tiny experts pack too
    model = _model(moe_path, ExpertPlacement.contiguous(NUM_EXPERTS, 2), 1)
    model.pack_weights()
    ep = model.expert_parallel
    assert ep is not None and all(e.packed is not None for e in _experts(model))
    held = [list(cast(list[Any], e.packed)) for e in _experts(model)]
    ep.commit(ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 1), 0, moe_path))
    _assert_holds_checkpoint_experts(model, checkpoint, list(range(NUM_EXPERTS)))
    for experts, old in zip(_experts(model), held, strict=True):
        packed = cast(list[Any], experts.packed)
        assert all(packed[4 + i] is pair for i, pair in enumerate(old)), "held ones are shared"
    # All eight held now; going down to two reads nothing and releases the other six.
    dropped = [weakref.ref(cast(list[Any], e.packed)[0][0]) for e in _experts(model)]
    del held, packed, old
    reads.clear()
    ep.commit(ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 4), 2, moe_path))
    assert reads == []
    _assert_holds_checkpoint_experts(model, checkpoint, [4, 5])
    gc.collect()
    assert all(ref() is None for ref in dropped), "the released experts' weights are still held"


def test_fused_transformers_5_tensors_are_read_one_expert_at_a_time(
    tmp_path: Path, reads: list[tuple[str, int | None]]
) -> None:
    hf_model = make_hf_model("MixtralForCausalLM", num_local_experts=NUM_EXPERTS)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    file = tmp_path / "fused.safetensors"
    save_file(state, str(file))
    arch = arch_from_hf(hf_model)
    ep = ExpertParallel(ExpertPlacement.contiguous(NUM_EXPERTS, 4), 3)
    model = MixtralForCausalLM(arch, expert_parallel=ep)
    model.load_weights(state.items())
    ep.commit(ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 2), 0, str(file)))
    assert set(reads) == {
        (f"model.layers.{i}.mlp.experts.{n}", e)
        for i in range(2)
        for n in ("gate_up_proj", "down_proj")
        for e in range(4)
    }
    assert len(reads) == 2 * 2 * 4, "each expert row is read once"
    for i, experts in enumerate(_experts(model)):
        assert experts.expert_ids == [0, 1, 2, 3]
        prefix = f"model.layers.{i}.mlp.experts"
        torch.testing.assert_close(experts.w13, state[f"{prefix}.gate_up_proj"][:4])
        torch.testing.assert_close(experts.w2, state[f"{prefix}.down_proj"][:4])


def test_staging_refuses_a_placement_or_checkpoint_it_cannot_serve(
    moe_path: str, tmp_path: Path
) -> None:
    model = _model(moe_path, ExpertPlacement.contiguous(NUM_EXPERTS, 2), 0)
    ep = model.expert_parallel
    assert ep is not None
    with pytest.raises(ValueError, match="rank 4 holds no expert"):
        ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 4), 4, moe_path)
    with pytest.raises(ValueError, match="the placement has 16 experts, the model 8"):
        ep.stage(ExpertPlacement.contiguous(16, 2), 0, moe_path)
    empty = tmp_path / "empty.safetensors"
    save_file({"other": torch.zeros(1)}, str(empty))
    with pytest.raises(ModelLoadError, match=r"no weights of expert 4 in model\.layers\.0"):
        ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 2), 1, str(empty))
    assert all(e.expert_ids == [0, 1, 2, 3] for e in _experts(model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staging_on_the_gpu_keeps_the_weights_there(
    moe_path: str, checkpoint: dict[str, torch.Tensor]
) -> None:
    ep = ExpertParallel(ExpertPlacement.contiguous(NUM_EXPERTS, 2), 1)
    model = MixtralForCausalLM(load_model_arch(moe_path), expert_parallel=ep, device="cuda")
    model.load_weights(load_weights(moe_path))
    ep.commit(ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 1), 0, moe_path))
    for layer, experts in enumerate(_experts(model)):
        assert experts.w13.device.type == "cuda" and experts.w2.device.type == "cuda"
        for expert in range(NUM_EXPERTS):
            flat = torch.cat([experts.w13[expert].flatten(), experts.w2[expert].flatten()])
            torch.testing.assert_close(flat.cpu(), _expected(checkpoint, layer, expert))


# --- with real groups ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield int(master.port)


def _join(port: int, group_name: str, rank: int, world_size: int) -> ProcessGroups:
    rendezvous = Rendezvous("127.0.0.1", port, group_name=group_name)
    return ProcessGroups.join(
        rendezvous, rank, world_size, device=torch.device("cpu"), timeout_s=20
    )


def test_after_growing_to_all_experts_a_lone_rank_gives_the_dense_models_logits(
    moe_path: str, store_port: int
) -> None:
    arch = load_model_arch(moe_path)

    def runner(expert_parallel: ExpertParallel | None) -> ModelRunner:
        built = ModelRunner(
            ModelConfig(model=moe_path, dtype="float32"),
            CacheConfig(block_size=4, num_gpu_blocks_override=64),
            SchedulerConfig(max_num_batched_tokens=256),
            arch,
            max_model_len=128,
            device="cpu",
            expert_parallel=expert_parallel,
        )
        built.load_model(load_weights(moe_path))
        built.initialize_kv_cache(built.determine_num_blocks())
        return built

    ep = ExpertParallel(ExpertPlacement.contiguous(NUM_EXPERTS, 2), 0)
    served = runner(ep)
    ep.commit(ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 1), 0, moe_path))
    groups = _join(store_port, uuid.uuid4().hex[:8], 0, 1)
    ep.bind(groups)
    try:
        prompts = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
        tokens, logits = greedy_generate(served, prompts, 8)
    finally:
        groups.destroy()
    dense_tokens, dense_logits = greedy_generate(runner(None), prompts, 8)
    assert tokens == dense_tokens
    for rid, rows in dense_logits.logits.items():
        torch.testing.assert_close(torch.stack(logits.logits[rid]), torch.stack(rows))


def test_two_ranks_left_of_three_restage_while_serving_and_compute_the_full_layer(
    moe_path: str, store_port: int
) -> None:
    """contiguous(8, 3) → contiguous(8, 2): rank 2 leaves; ranks 0 and 1 stage on a background
    thread while a forward runs on the old groups, commit unbound, and bind the new groups."""
    arch = load_model_arch(moe_path)
    full = MixtralForCausalLM(arch)
    full.load_weights(load_weights(moe_path))
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(n, arch.hidden_size, generator=gen) for n in (4, 3, 2)]
    with torch.no_grad():
        expected = [full.get_submodule("layers.1.mlp")(x) for x in batches]
    old_name, new_name = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    results: dict[tuple[str, int], torch.Tensor] = {}
    errors: list[BaseException] = []

    def forward(ep: ExpertParallel, model: MixtralForCausalLM, x: torch.Tensor) -> torch.Tensor:
        ep.begin_forward(x.shape[0])
        with torch.no_grad():
            return model.get_submodule("layers.1.mlp")(x)

    def run(rank: int) -> None:
        try:
            model = _model(moe_path, ExpertPlacement.contiguous(NUM_EXPERTS, 3), rank)
            ep = model.expert_parallel
            assert ep is not None
            groups = _join(store_port, old_name, rank, 3)
            ep.bind(groups)
            staged: list[Any] = []
            stager = threading.Thread(
                target=lambda: staged.append(
                    ep.stage(ExpertPlacement.contiguous(NUM_EXPERTS, 2), rank, moe_path)
                )
            )
            if rank < 2:
                stager.start()
            results["old", rank] = forward(ep, model, batches[rank])
            if rank < 2:
                stager.join()
            ep.unbind()
            groups.destroy()
            if rank == 2:
                return
            ep.commit(staged.pop())
            new_groups = _join(store_port, new_name, rank, 2)
            ep.bind(new_groups)
            results["new", rank] = forward(ep, model, batches[rank])
            new_groups.destroy()
        except BaseException as e:
            errors.append(e)
            raise

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(results) == [("new", 0), ("new", 1), ("old", 0), ("old", 1), ("old", 2)]
    # The ranks sum each token's experts in another order than the full layer (and run their
    # matmuls on other row counts): equal up to reordered fp32 sums over gate/up, down, top-k.
    length = arch.hidden_size + arch.intermediate_size + arch.num_experts_per_tok
    for (_, rank), out in results.items():
        assert_reordered_close(out, expected[rank], length=length)
