"""Expert parallelism in-process: ranks on threads, a real TCPStore rendezvous, gloo groups, real
ZMQ engines. Greedy tokens across 2 and 4 ranks equal the single-rank engine's and HF's; each
rank holds only its experts; the ranks step in DP waves and pause together."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import msgspec
import pytest
import torch
import zmq
from torch.distributed import TCPStore

from shoal.engine.config import EngineConfig
from shoal.engine.loader import load_model_arch
from shoal.engine.model.executor import UniProcExecutor
from shoal.engine.parallel.distributed import Rendezvous
from shoal.engine.parallel.dp_wave import SYNC_INTERVAL
from shoal.engine.parallel.expert_parallel import ExpertPlacement, make_expert_parallel
from shoal.engine.protocol import EngineCoreRequestType, EngineStatsReport
from tests.engine.core_proc_utils import RawPeer, ServedEngine, request, tiny_config, wait_until
from tests.factories import make_tiny_checkpoint
from tests.reference import assert_greedy_matches, hf_greedy
from tests.tolerances import assert_reordered_close

NUM_EXPERTS = 8
MAX_TOKENS = 10


def test_contiguous_placement_gives_the_first_ranks_the_remainder() -> None:
    placement = ExpertPlacement.contiguous(8, 3)
    assert placement.as_dict() == {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7]}
    assert ExpertPlacement.contiguous(8, 4).experts_of(3) == [6, 7]
    assert ExpertPlacement.contiguous(8, 8).experts_of(5) == [5]
    with pytest.raises(ValueError, match=r"needs 1\.\.8 ranks"):
        ExpertPlacement.contiguous(8, 9)


def test_any_table_is_a_placement_if_every_rank_holds_an_expert() -> None:
    placement = ExpertPlacement((1, 0, 1, 0), 2)
    assert placement.experts_of(0) == [1, 3]
    with pytest.raises(ValueError, match="every one of 3 ranks"):
        ExpertPlacement((0, 0, 1, 1), 3)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("moe"), "mixtral", num_experts=NUM_EXPERTS, top_k=2, seed=3
    )


def test_expert_parallelism_is_refused_on_a_dense_model(tmp_path) -> None:
    dense = make_tiny_checkpoint(tmp_path, "llama")
    config = EngineConfig.from_kwargs(dense, data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        make_expert_parallel(config, load_model_arch(dense))


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield int(master.port)


class EPEngines:
    """N expert-parallel engines on threads of this process, a raw client on each, and the
    stats reports they push (as the coordinator would get them)."""

    def __init__(self, path: str, num_ranks: int, port: int) -> None:
        rendezvous = Rendezvous("127.0.0.1", port, group_name=uuid.uuid4().hex[:8])
        self.ctx = zmq.Context()
        self.stats = self.ctx.socket(zmq.PULL)
        stats_port = self.stats.bind_to_random_port("tcp://127.0.0.1")
        self.engines: list[ServedEngine] = []
        built: dict[int, ServedEngine] = {}

        def build(rank: int) -> None:
            config = tiny_config(
                path,
                data_parallel_size=num_ranks,
                data_parallel_rank=rank,
                enable_expert_parallel=True,
                collective_timeout_s=5.0,
            )
            built[rank] = ServedEngine(
                config,
                engine_index=rank,
                rendezvous=rendezvous,
                stats_address=f"tcp://127.0.0.1:{stats_port}",
            )

        threads = [threading.Thread(target=build, args=(r,)) for r in range(num_ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        self.engines = [built[r] for r in range(num_ranks)]
        self.peers = [RawPeer(e.endpoint) for e in self.engines]
        for peer in self.peers:
            peer.hello_until_accepted()
        self.latest: dict[int, EngineStatsReport] = {}
        self._decoder = msgspec.msgpack.Decoder(EngineStatsReport)

    def reports(self) -> dict[int, EngineStatsReport]:
        """The latest stats report of every rank so far."""
        while self.stats.poll(0):
            report = self._decoder.decode(self.stats.recv())
            self.latest[report.engine_index] = report
        return self.latest

    def generate(self, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        """Sends prompt i to rank i % N, all at once; the greedy tokens of each."""
        n = len(self.peers)
        for i, prompt in enumerate(prompts):
            req = request(f"p{i}", prompt, max_tokens=max_tokens)
            self.peers[i % n].send_typed(EngineCoreRequestType.ADD, req)
        tokens: dict[str, list[int]] = {}
        for rank, peer in enumerate(self.peers):
            ids = {f"p{i}" for i in range(len(prompts)) if i % n == rank}
            for rid, outputs in peer.collect_until_finished(ids, timeout_s=60).items():
                tokens[rid] = [t for o in outputs for t in o.new_token_ids]
        return [tokens[f"p{i}"] for i in range(len(prompts))]

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        # All at once, as a cluster stops: a rank mid-wave leaves its peers' collectives.
        for engine in self.engines:
            engine.proc.shutdown()
        for engine in self.engines:
            engine.stop()
        self.ctx.destroy(linger=0)


@contextmanager
def ep_engines(path: str, num_ranks: int, port: int) -> Iterator[EPEngines]:
    engines = EPEngines(path, num_ranks, port)
    try:
        yield engines
    finally:
        engines.close()


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [
        torch.randint(1, 500, (int(length),), generator=gen).tolist()
        for length in torch.randint(3, 20, (n,), generator=gen)
    ]


def _num_params(engine: ServedEngine) -> int:
    executor = engine.proc.engine_core.executor
    assert isinstance(executor, UniProcExecutor)
    model = executor.worker.model_runner.model
    assert model is not None
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def single_rank_tokens(moe_path: str) -> tuple[list[list[int]], int]:
    """The single-rank engine's greedy tokens for `_prompts(8)`, and its parameter count."""
    from tests.engine.core_proc_utils import running_engine

    prompts = _prompts(8)
    with running_engine(tiny_config(moe_path)) as engine:
        peer = RawPeer(engine.endpoint)
        peer.hello_until_accepted()
        for i, prompt in enumerate(prompts):
            peer.send_typed(EngineCoreRequestType.ADD, request(f"p{i}", prompt, max_tokens=10))
        seen = peer.collect_until_finished({f"p{i}" for i in range(len(prompts))})
        peer.close()
        tokens = [[t for o in seen[f"p{i}"] for t in o.new_token_ids] for i in range(len(prompts))]
        return tokens, _num_params(engine)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_ep_greedy_tokens_equal_the_single_rank_engine_and_hf(
    moe_path: str,
    store_port: int,
    single_rank_tokens: tuple[list[list[int]], int],
    num_ranks: int,
) -> None:
    import transformers

    expected, full_params = single_rank_tokens
    prompts = _prompts(8)
    with ep_engines(moe_path, num_ranks, store_port) as cluster:
        assert cluster.generate(prompts) == expected
        # Each rank holds only its experts: the full model less the others' expert weights.
        arch = load_model_arch(moe_path)
        per_expert = 3 * arch.hidden_size * arch.intermediate_size * arch.num_hidden_layers
        for rank, engine in enumerate(cluster.engines):
            held = len(ExpertPlacement.contiguous(NUM_EXPERTS, num_ranks).experts_of(rank))
            assert _num_params(engine) == full_params - (NUM_EXPERTS - held) * per_expert
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(moe_path).eval()
    for i, prompt in enumerate(prompts):
        assert_greedy_matches(expected[i], hf_greedy(hf_model, prompt, MAX_TOKENS), label=f"p{i}")


def test_idle_ranks_step_dummy_batches_until_the_wave_ends_then_all_pause(
    moe_path: str, store_port: int
) -> None:
    with ep_engines(moe_path, 2, store_port) as cluster:
        reports = cluster.reports
        assert wait_until(lambda: len(reports()) == 2, 5)
        assert all(not r.is_wave_running and r.current_wave == 0 for r in reports().values())
        long = request("long", [5, 6, 7], max_tokens=120)
        cluster.peers[0].send_typed(EngineCoreRequestType.ADD, long)
        # Rank 1 has nothing, yet steps (dummy forwards) while rank 0's request runs.
        assert wait_until(lambda: reports()[1].num_dummy_steps > 20, 20)
        assert reports()[1].stats.num_running_reqs == 0
        done = cluster.peers[0].collect_until_finished({"long"}, timeout_s=60)
        assert sum(len(o.new_token_ids) for o in done["long"]) == 120
        # The wave ends within SYNC_INTERVAL forwards of the last finish; both ranks pause.
        assert wait_until(
            lambda: all(not r.is_wave_running and r.current_wave == 1 for r in reports().values()),
            5,
        )
        paused = {r: (rep.num_dummy_steps, rep.stats.step_counter) for r, rep in reports().items()}
        assert paused[1][0] >= 120 - SYNC_INTERVAL
        time.sleep(0.5)
        now = {r: (rep.num_dummy_steps, rep.stats.step_counter) for r, rep in reports().items()}
        assert now == paused, "a paused rank kept stepping"
        # A request on rank 1 alone starts the next wave on both ranks.
        cluster.peers[1].send_typed(
            EngineCoreRequestType.ADD, request("next", [9, 8], max_tokens=4)
        )
        cluster.peers[1].collect_until_finished({"next"})
        assert wait_until(lambda: all(r.current_wave == 2 for r in reports().values()), 5)
        assert reports()[0].num_dummy_steps > paused[0][0]


def test_the_exchange_over_uneven_shares_and_an_idle_rank_equals_the_full_layer(
    store_port: int,
) -> None:
    """8 experts over 3 ranks (3, 3, 2); rank 1 has no tokens but serves its experts."""
    from shoal.engine.model.mixtral import MixtralForCausalLM
    from shoal.engine.parallel.distributed import ProcessGroups
    from shoal.engine.parallel.expert_parallel import ExpertParallel
    from tests.engine.model_utils import arch_from_hf, make_hf_model

    hf_model = make_hf_model("MixtralForCausalLM", num_local_experts=8)
    arch = arch_from_hf(hf_model)
    weights = dict(hf_model.state_dict())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, arch.hidden_size, generator=gen) for n in (5, 0, 2)]
    full = MixtralForCausalLM(arch)
    full.load_weights(weights.items())
    with torch.no_grad():
        expected = [full.get_submodule("layers.0.mlp")(x) for x in batches]
    rendezvous = Rendezvous("127.0.0.1", store_port, group_name=uuid.uuid4().hex[:8])
    results: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        ep = ExpertParallel(ExpertPlacement.contiguous(8, 3), rank)
        model = MixtralForCausalLM(arch, expert_parallel=ep)
        model.load_weights(weights.items())
        groups = ProcessGroups.join(rendezvous, rank, 3, device=torch.device("cpu"), timeout_s=10)
        ep.bind(groups)
        ep.begin_forward(batches[rank].shape[0])
        with torch.no_grad():
            results[rank] = model.get_submodule("layers.0.mlp")(batches[rank])
        groups.destroy()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1, 2]
    # Summed over the exchange in another order than the full layer: see tests/tolerances.py.
    length = arch.hidden_size + arch.intermediate_size + arch.num_experts_per_tok
    for rank in range(3):
        assert_reordered_close(results[rank], expected[rank], length=length)
