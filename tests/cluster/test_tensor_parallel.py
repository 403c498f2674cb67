"""Tensor parallelism with data parallelism on a real local Ray cluster: two ranks of two workers,
each rank in a placement group that reserves a CPU per worker; both ranks serve the same greedy
tokens, and the status shows the TP size."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.util.placement_group import placement_group_table

from shoal.client.core_client import SyncMPClient
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.cluster.ranks import default_resources
from shoal.deploy.status import format_status
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair
from shoal.engine.protocol import EngineCoreRequest, EngineEndpoint, SamplingParams
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(ray_local: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    config = EngineConfig.from_kwargs(
        path,
        data_parallel_size=2,
        tensor_parallel_size=2,
        num_gpu_blocks_override=32,
        max_model_len=128,
    )
    assert default_resources(2) == RankResources(num_cpus=2)  # the local cluster has no GPU
    options = LaunchOptions(default_resources(2), host="127.0.0.1", ready_timeout_s=180)
    handle = launch(config, options, namespace=unique_namespace("tp"))
    yield handle
    handle.shutdown()


def _serve(cluster: ClusterHandle, endpoint: EngineEndpoint) -> tuple[list[int], list[int]]:
    """(greedy tokens of one request, KV bytes per block of each of the rank's workers)."""
    keys = CurveKeyPair.generate()
    client_index = ray.get(cluster.registry.attach_client.remote("tp-test", keys.public))
    client = SyncMPClient([endpoint], client_index=client_index, curve_keys=keys)
    try:
        per_worker = client.call_utility("collective_rpc", "bytes_per_block", [])
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        client.add_request(EngineCoreRequest("r0", [5, 6, 7, 8], params))
        tokens: list[int] = []
        while True:
            for output in client.get_output(timeout=60).outputs:
                tokens += output.new_token_ids
                if output.finished:
                    return tokens, per_worker
    finally:
        client.shutdown()
        ray.get(cluster.registry.detach_client.remote(client_index))


def test_two_ranks_of_two_workers_serve_in_two_placement_groups(cluster: ClusterHandle) -> None:
    served = [_serve(cluster, e) for e in cluster.membership().routable_endpoints()]
    assert len(served) == 2
    assert served[0][0] == served[1][0] and len(served[0][0]) == 6
    assert [len(per_worker) for _, per_worker in served] == [2, 2]  # four workers in all
    table = {e["name"]: e for e in placement_group_table().values() if e["state"] == "CREATED"}
    for rank in (0, 1):
        entry = table[f"shoal-{cluster.namespace}-rank-{rank}"]
        assert entry["bundles"] == {0: {"CPU": 2.0}} and entry["strategy"] == "STRICT_PACK"
    status = cluster.status()
    assert status["tensor_parallel_size"] == 2
    assert "TP 2 (4 workers)" in format_status(status)


def test_a_tp_size_the_model_cannot_split_is_refused_before_anything_starts(
    ray_local: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("three"), "llama")
    config = EngineConfig.from_kwargs(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        launch(config, LaunchOptions(RankResources(num_cpus=1)), namespace=unique_namespace("x"))
    with pytest.raises(ValueError, match="--num-gpus-per-rank 1 conflicts with"):
        two = EngineConfig.from_kwargs(path, tensor_parallel_size=2)
        launch(two, LaunchOptions(RankResources(num_cpus=1, num_gpus=1)), namespace="y")
