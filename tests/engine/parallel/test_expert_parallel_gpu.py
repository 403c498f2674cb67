"""The CUDA path of expert parallelism: NCCL device groups built directly (no default group) and
the MoE exchange on them, one rank per GPU on threads of this process. Skipped without a GPU
(the `gpu` marker); the multi-rank cases need one GPU per rank."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from shoal.engine.model.mixtral import MixtralForCausalLM, MixtralMoE
from shoal.engine.parallel.distributed import ProcessGroups, Rendezvous
from shoal.engine.parallel.expert_parallel import ExpertParallel, ExpertPlacement
from tests.engine.model_utils import arch_from_hf, make_hf_model

pytestmark = pytest.mark.gpu

_NUM_GPUS = torch.cuda.device_count()


def _on_gpus(num_ranks: int, body: Callable[[int, ProcessGroups], Any]) -> list[Any]:
    """body(rank, groups) on one thread per GPU, each rank's groups on cuda:<rank>."""
    if not torch.cuda.is_available() or num_ranks > _NUM_GPUS:
        pytest.skip(f"needs {num_ranks} CUDA device(s)")
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    rendezvous = Rendezvous("127.0.0.1", master.port, group_name=uuid.uuid4().hex[:8])
    results: list[Any] = [None] * num_ranks

    def run(rank: int) -> None:
        try:
            device = torch.device(f"cuda:{rank}")
            torch.cuda.set_device(device)
            groups = ProcessGroups.join(rendezvous, rank, num_ranks, device=device, timeout_s=60)
            try:
                results[rank] = body(rank, groups)
            finally:
                groups.destroy()
        except BaseException as e:
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_nccl_device_group_reduces_on_the_gpu(num_ranks: int) -> None:
    def body(rank: int, groups: ProcessGroups) -> list[float]:
        assert groups.device_type == "cuda"
        tensor = torch.full((4,), float(rank + 1), device=f"cuda:{rank}")
        groups.device.allreduce([tensor]).wait()
        torch.cuda.synchronize()
        return tensor.cpu().tolist()

    total = float(sum(range(1, num_ranks + 1)))
    assert _on_gpus(num_ranks, body) == [[total] * 4] * num_ranks


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_moe_exchange_over_nccl_equals_the_layer_with_every_expert(num_ranks: int) -> None:
    hf_model = make_hf_model("MixtralForCausalLM")
    arch = arch_from_hf(hf_model)
    weights = dict(hf_model.state_dict())
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(3 + 4 * r, arch.hidden_size, generator=gen) for r in range(num_ranks)]
    full = MixtralForCausalLM(arch)
    full.load_weights(weights.items())
    full_moe = full.get_submodule("layers.0.mlp")
    with torch.no_grad():
        expected = [full_moe(x) for x in batches]

    def body(rank: int, groups: ProcessGroups) -> torch.Tensor:
        placement = ExpertPlacement.contiguous(arch.num_local_experts, num_ranks)
        ep = ExpertParallel(placement, rank)
        device = torch.device(f"cuda:{rank}")
        model = MixtralForCausalLM(arch, expert_parallel=ep, device=device)
        model.load_weights(weights.items())
        ep.bind(groups)
        moe = model.get_submodule("layers.0.mlp")
        assert isinstance(moe, MixtralMoE)
        x = batches[rank].to(device)
        ep.begin_forward(x.shape[0])
        with torch.no_grad():
            out = moe(x)
        torch.cuda.synchronize()
        return out.cpu()

    for got, want in zip(_on_gpus(num_ranks, body), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
