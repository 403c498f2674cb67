"""Expert parallelism on the CPU: what the MoE exchange costs, and what DP waves cost.

Part 1, the exchange. One MoE layer (8 experts, top-2) on N = 2 and 4 rank processes over
gloo, per-rank batches of T tokens: the expert-parallel layer (all-gather, route, local experts,
reduce-scatter) and the exchange alone — the all-gather + reduce-scatter shoal uses and an
all-to-all dispatch/combine (split sizes, tokens out, results back) for comparison — against
the same layer computed locally with every expert. Per step = per layer x the layers of the
model plus the one token-count exchange of the step.

Part 2, the waves. A tiny Mixtral on two engine processes; a trace that sends every request
to rank 0 in bursts (rank 1 idle throughout): throughput with expert parallelism (rank 1
steps dummy forwards in lockstep, serving its experts) against the same model and trace with
EP off (each rank holds every expert and steps on its own; rank 1 does nothing).

    .venv/bin/python bench/expert_parallel.py [--iters 30] [--quick] [--part exchange|waves]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import zmq
from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import cpu_kind
from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.model.mixtral import MixtralMoE
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.distributed import ProcessGroups, Rendezvous
from shoal.engine.parallel.expert_parallel import ExpertParallel, ExpertPlacement
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineEndpoint,
    EngineHello,
    SamplingParams,
)
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder

NUM_EXPERTS, TOP_K, HIDDEN, EXPERT_WIDTH, NUM_LAYERS = 8, 2, 512, 1024, 8
ARCH = ModelArch(
    "MixtralForCausalLM", 1024, HIDDEN, EXPERT_WIDTH, NUM_LAYERS, 8, 8, 64, 1e-5, 1e6, 512,
    num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
)  # fmt: skip
BATCH_SIZES = (1, 16, 128)


def _moe(expert_parallel: ExpertParallel | None) -> MixtralMoE:
    """The layer with fixed random weights (the same for every rank's share)."""
    moe = MixtralMoE(
        ARCH, expert_parallel=expert_parallel, dtype=torch.float32, device=torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * EXPERT_WIDTH, HIDDEN, generator=gen) * 0.02
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, EXPERT_WIDTH, generator=gen) * 0.02
    held = torch.tensor(moe.experts.expert_ids)
    with torch.no_grad():
        moe.router.linear.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN, generator=gen) * 0.02)
        moe.experts.w13.copy_(w13.index_select(0, held))
        moe.experts.w2.copy_(w2.index_select(0, held))
    return moe


def _median_ms(fn: Any, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _all_to_all(groups: ProcessGroups, x: torch.Tensor, placement: torch.Tensor) -> torch.Tensor:
    """Dispatch each (token, expert) row to its expert's owner and back: the exchange only
    (random top-k routing)."""
    n = groups.world_size
    owners = placement[torch.randint(0, NUM_EXPERTS, (x.shape[0] * TOP_K,))]
    order = torch.argsort(owners, stable=True)
    send = x.index_select(0, order // TOP_K)
    send_counts = torch.bincount(owners, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    groups.device.alltoall_base(recv_counts, send_counts, [1] * n, [1] * n).wait()
    splits_out, splits_in = send_counts.tolist(), recv_counts.tolist()
    received = x.new_empty(sum(splits_in), x.shape[1])
    groups.device.alltoall_base(received, send, splits_in, splits_out).wait()
    back = x.new_empty(send.shape)
    groups.device.alltoall_base(back, received, splits_out, splits_in).wait()
    return back


def _layer(moe: MixtralMoE, x: torch.Tensor) -> None:
    with torch.inference_mode():
        moe(x)


def _exchange_worker(rank: int, n: int, port: int, iters: int, results: Any) -> None:
    torch.set_num_threads(1)
    rendezvous = Rendezvous("127.0.0.1", port, group_name=f"x{n}")
    groups = ProcessGroups.join(rendezvous, rank, n, device=torch.device("cpu"), timeout_s=60)
    ep = ExpertParallel(ExpertPlacement.contiguous(NUM_EXPERTS, n), rank)
    moe = _moe(ep)
    ep.bind(groups)
    placement = torch.tensor(ep.placement.expert_to_rank)
    for tokens in BATCH_SIZES:
        x = torch.randn(tokens, HIDDEN)
        ep.begin_forward(tokens)  # once per step: the shapes every layer of the step uses
        times = {
            "layer": _median_ms(lambda x=x: _layer(moe, x), iters),
            "agrs": _median_ms(lambda x=x: ep.exchange(x, lambda gathered: gathered), iters),
            "a2a": _median_ms(lambda x=x: _all_to_all(groups, x, placement), iters),
            "counts": _median_ms(lambda t=tokens: groups.all_gather_ints(t), iters),
        }
        if rank == 0:
            results.put((n, tokens, times))
    groups.destroy()


def bench_exchange(iters: int, sizes: tuple[int, ...]) -> None:
    torch.set_num_threads(1)
    local = _moe(None)
    print(f"MoE layer: {NUM_EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, expert width "
          f"{EXPERT_WIDTH}; a step of the model = {NUM_LAYERS} layers")  # fmt: skip
    baseline = {}
    for tokens in BATCH_SIZES:
        x = torch.randn(tokens, HIDDEN)
        with torch.inference_mode():
            baseline[tokens] = _median_ms(lambda x=x: local(x), iters)
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    print(f"\n{'N':>2} {'T/rank':>6} {'local all':>10} {'EP layer':>9} {'ratio':>6} "
          f"{'AG+RS':>7} {'A2A':>7} {'counts':>7} {'EP step':>8} {'local step':>10}  (ms)")  # fmt: skip
    for n in sizes:
        results = context.Queue()
        workers = [
            context.Process(target=_exchange_worker, args=(r, n, master.port, iters, results))
            for r in range(n)
        ]
        for w in workers:
            w.start()
        rows = [results.get(timeout=600) for _ in BATCH_SIZES]
        for w in workers:
            w.join(timeout=60)
        for _, tokens, t in rows:
            ep_step = NUM_LAYERS * t["layer"] + t["counts"]
            local_step = NUM_LAYERS * baseline[tokens]
            print(
                f"{n:>2} {tokens:>6} {baseline[tokens]:>10.3f} {t['layer']:>9.3f} "
                f"{t['layer'] / baseline[tokens]:>6.2f} {t['agrs']:>7.3f} {t['a2a']:>7.3f} "
                f"{t['counts']:>7.3f} {ep_step:>8.2f} {local_step:>10.2f}"
            )


class _Driver:
    """A minimal client of several engines: HELLO, ADD, collect finished requests."""

    def __init__(self, endpoints: list[EngineEndpoint]) -> None:
        self.ctx = zmq.Context()
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.identities = [e.identity for e in endpoints]
        for endpoint in endpoints:
            self.router.setsockopt(zmq.CONNECT_ROUTING_ID, endpoint.identity)
            self.router.connect(endpoint.input_address)
        time.sleep(0.3)
        for i, identity in enumerate(self.identities):
            hello = EngineHello(0, f"tcp://127.0.0.1:{port}", call_id=100 + i)
            self._send(identity, EngineCoreRequestType.HELLO, hello)
        for _ in self.identities:
            self.decoder.decode(self.pull.recv_multipart())

    def _send(self, identity: bytes, kind: EngineCoreRequestType, payload: Any) -> None:
        self.router.send_multipart([identity, kind.value, *self.encoder.encode(payload)])

    def add(self, rank: int, request: EngineCoreRequest) -> None:
        self._send(self.identities[rank], EngineCoreRequestType.ADD, request)

    def collect(self, num_requests: int) -> int:
        """Blocks until `num_requests` requests finished; returns the tokens they generated."""
        num_tokens = num_finished = 0
        while num_finished < num_requests:
            outputs = self.decoder.decode(self.pull.recv_multipart())
            for output in outputs.outputs:
                num_tokens += len(output.new_token_ids)
                num_finished += output.finished
        return num_tokens

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _run_trace(driver: _Driver, bursts: int, per_burst: int, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    num_tokens = 0
    for burst in range(bursts):
        for i in range(per_burst):
            prompt = [(7 * burst + 3 * i + j) % 500 + 1 for j in range(24)]
            driver.add(0, EngineCoreRequest(f"b{burst}-{i}-{uuid.uuid4().hex[:6]}", prompt, params))
        num_tokens += driver.collect(per_burst)
        time.sleep(0.2)  # the cluster goes idle between bursts: waves end and start again
    return time.perf_counter() - start - 0.2 * bursts, num_tokens


def _start_ranks(path: str, enable_ep: bool, rendezvous: Rendezvous) -> dict[int, Any]:
    """Two engine processes, started at once (expert-parallel ranks wait for each other)."""
    procs: dict[int, Any] = {}

    def start(rank: int) -> None:
        config = EngineConfig.from_kwargs(
            path, data_parallel_size=2, data_parallel_rank=rank, cpu_threads=1,
            enable_expert_parallel=enable_ep, num_gpu_blocks_override=256,
        )  # fmt: skip
        extra = {"rendezvous": rendezvous} if enable_ep else {}
        procs[rank] = start_engine_process(config, engine_index=rank, **extra)

    threads = [threading.Thread(target=start, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return procs


def bench_waves(bursts: int, per_burst: int, max_tokens: int, repeats: int) -> None:
    from tests.factories import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tempfile.mkdtemp(), "mixtral", num_experts=NUM_EXPERTS, top_k=TOP_K,
        hidden_size=256, intermediate_size=512, num_layers=4,
    )  # fmt: skip
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    print(f"\nwaves: {bursts} bursts of {per_burst} requests x {max_tokens} tokens, all on rank 0")
    # Both pairs run side by side, their traces alternating, so both see the same load.
    pairs = {
        ep: _start_ranks(path, ep, Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex[:8]))
        for ep in (False, True)
    }
    drivers = {ep: _Driver([procs[r][1] for r in range(2)]) for ep, procs in pairs.items()}
    ratios = []
    try:
        for driver in drivers.values():
            _run_trace(driver, 1, per_burst, 8)  # warm-up
        for rep in range(repeats):
            throughput = {}
            for ep, driver in drivers.items():
                elapsed, num_tokens = _run_trace(driver, bursts, per_burst, max_tokens)
                throughput[ep] = num_tokens / elapsed
            ratios.append(throughput[True] / throughput[False])
            print(f"  run {rep}: EP off (independent ranks) {throughput[False]:6.1f} tok/s, "
                  f"EP on (waves, dummy forwards on rank 1) {throughput[True]:6.1f} tok/s: "
                  f"{ratios[-1]:.2f}")  # fmt: skip
    finally:
        for driver in drivers.values():
            driver.close()
        for procs in pairs.values():
            for process, _ in procs.values():
                stop_engine_process(process)
    print(f"  EP on / EP off throughput: median {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="2 ranks only, a short trace")
    parser.add_argument("--part", choices=("all", "exchange", "waves"), default="all")
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    if args.part in ("all", "exchange"):
        bench_exchange(args.iters, (2,) if args.quick else (2, 4))
    if args.part in ("all", "waves") and args.quick:
        bench_waves(bursts=2, per_burst=4, max_tokens=16, repeats=2)
    elif args.part in ("all", "waves"):
        bench_waves(bursts=3, per_burst=6, max_tokens=32, repeats=3)


if __name__ == "__main__":
    main()
