"""`shoal serve` / `python -m shoal.deploy.serve`: launch a named cluster and serve until stopped.

This is the command users put behind `ray job submit -- ...`. It connects to Ray, launches
the cluster, logs one line with the namespace and ranks once every rank serves, then waits
for `shoal stop` (the registry's stop flag), SIGTERM or SIGINT, and tears the cluster down
(no actor, no placement group left) before exiting 0. With `--port`, it also serves the
OpenAI API (`shoal.deploy.openai`) from a thread of this process while the cluster runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from types import FrameType

import ray

from shoal.cluster.launch import (
    DEFAULT_NAMESPACE,
    READY_TIMEOUT_S,
    ClusterExistsError,
    EngineStartError,
    check_launchable,
    launch,
)
from shoal.cluster.placement import RankResources
from shoal.deploy.openai.server import FrontEndThread, add_http_args, front_end_config
from shoal.engine.config import EngineConfig, add_engine_cli_args, engine_kwargs_from_cli

logger = logging.getLogger("shoal.serve")


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """--address and --namespace, shared by every subcommand that talks to a cluster."""
    parser.add_argument(
        "--address",
        default="auto",
        help="Ray address for ray.init (default: auto, i.e. RAY_ADDRESS or the local node)",
    )
    parser.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help="the cluster's Ray namespace"
    )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `shoal serve`: model, cluster layout, and every engine flag."""
    parser.add_argument("--model", required=True, help="local HF directory or .gguf file")
    add_ray_args(parser)
    parser.add_argument(
        "--data-parallel-address",
        default=None,
        help="address engines and coordinator bind (default: node IP)",
    )
    add_http_args(parser, port_default=None)
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="HTTP front ends this process runs (1; attach more with `shoal api-server`)",
    )
    add_rank_args(parser)
    parser.add_argument(
        "--detached",
        action="store_true",
        help="return once the cluster serves, leaving it running (stop it with `shoal stop`)",
    )
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    add_engine_cli_args(parser, skip=("data_parallel_rank",))


def add_rank_args(parser: argparse.ArgumentParser) -> None:
    """What each rank reserves and how ranks are placed (`shoal serve`, `shoal scale`)."""
    parser.add_argument("--num-cpus-per-rank", type=float, default=1.0)
    parser.add_argument(
        "--num-gpus-per-rank",
        type=float,
        default=None,
        help="GPUs each rank reserves (default: 1 if the cluster has GPUs, else 0)",
    )
    parser.add_argument("--placement-strategy", choices=("pack", "spread"), default="pack")


def rank_resources(args: argparse.Namespace) -> RankResources:
    """The reservation of `add_rank_args`' flags (after ray.init: the default looks for GPUs)."""
    num_gpus = args.num_gpus_per_rank
    if num_gpus is None:
        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    return RankResources(num_cpus=args.num_cpus_per_rank, num_gpus=num_gpus)


def connect_ray(address: str, namespace: str, *, can_start_local: bool) -> None:
    """ray.init at `address`; with "auto" and no running Ray, a local instance if allowed.

    Raises:
        ConnectionError: no Ray cluster at the address (and none may be started).
    """
    if ray.is_initialized():
        return
    _check_reachable(address)
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    except ConnectionError:
        if address != "auto" or not can_start_local:
            raise
        logger.info("no running Ray cluster found; starting a local one")
        ray.init(namespace=namespace, log_to_driver=False)


def _check_reachable(address: str) -> None:
    """Fails fast where ray.init would retry for minutes: nothing listens at HOST:PORT."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return  # "auto", "local", or a scheme Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as e:
        raise ConnectionError(f"nothing listens at {address}: {e}") from e


class _StopSignals:
    """SIGTERM / SIGINT: abort a launch in progress, or end serving once the cluster runs."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.is_serving = False

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        logger.info("received %s", signal.Signals(signum).name)
        self.event.set()
        if not self.is_serving:
            raise KeyboardInterrupt  # launch() tears down what it started, then re-raises


def run(args: argparse.Namespace) -> int:
    """Runs `shoal serve` with parsed arguments. Returns the exit code."""
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs_from_cli(args))
    if args.api_server_count != 1:
        logger.error(
            "--api-server-count %d: `shoal serve` runs one front end; attach more, on any "
            "node, with `shoal api-server --namespace %s --port P`",
            args.api_server_count,
            args.namespace,
        )
        return 2
    if args.port is not None and args.detached:
        logger.error("--port serves from this process, which --detached leaves at once")
        return 2
    try:
        check_launchable(config)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    stop = _StopSignals()
    try:
        connect_ray(args.address, args.namespace, can_start_local=True)
        stop.install()  # after ray.init, which installs a SIGTERM handler of its own
        handle = launch(
            config,
            namespace=args.namespace,
            resources=rank_resources(args),
            placement_strategy=args.placement_strategy,
            host=args.data_parallel_address,
            detached=args.detached,
            ready_timeout_s=args.ready_timeout,
        )
        stop.is_serving = True
    except ClusterExistsError as e:
        logger.error("%s", e)
        return 1
    except EngineStartError as e:  # the engine's traceback, not this process's
        logger.error("%s\n%s", e, e.__cause__)
        return 1
    except KeyboardInterrupt:
        logger.info("interrupted while launching; nothing is left running")
        return 130
    except Exception:
        logger.exception("launch failed")
        return 1
    try:
        membership = handle.membership()
        endpoints = {r: i.endpoint.input_address for r, i in membership.ranks.items() if i.endpoint}
        logger.info(
            "shoal cluster ready: namespace=%s ranks=%s model=%s endpoints=%s",
            args.namespace,
            sorted(membership.ranks),
            args.model,
            endpoints,
        )
        if args.detached:
            logger.info("detached: stop it with `shoal stop --namespace %s`", args.namespace)
            return 0
        ray.get(handle.registry.set_served_by.remote(f"{socket.gethostname()}:{os.getpid()}"))
        front_end = _start_front_end(args)
        try:
            handle.wait_until_stop_requested(
                poll_s=1.0,
                should_stop=lambda: (
                    stop.event.is_set() or (front_end is not None and not front_end.is_alive)
                ),
            )
        finally:
            if front_end is not None:
                front_end.stop()
        if front_end is not None and front_end.error is not None:
            raise front_end.error
    except BaseException:
        logger.exception("serving failed; tearing the cluster down")
        handle.shutdown()
        return 1
    logger.info("stopping the cluster in namespace %s", args.namespace)
    handle.shutdown()
    logger.info("cluster in namespace %s stopped", args.namespace)
    return 0


def _start_front_end(args: argparse.Namespace) -> FrontEndThread | None:
    """The HTTP front end of `--port`, serving from a thread of this process."""
    if args.port is None:
        return None
    front_end = FrontEndThread(front_end_config(args, args.port))
    front_end.start()
    return front_end


def configure_logging() -> None:
    """INFO logs on stderr: stdout carries only what a command prints (`--json` documents)."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m shoal.deploy.serve ARGS`, the same as `shoal serve ARGS`."""
    parser = argparse.ArgumentParser(prog="shoal serve", description=__doc__)
    add_serve_args(parser)
    configure_logging()
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
