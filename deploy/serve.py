"""`shoal serve` / `python -m shoal.deploy.serve`: launch a named cluster and serve until stopped.

This is the command users put behind `ray job submit -- ...`. It connects to Ray, launches
the cluster (logging each rank's start as it goes: waiting for room, its weights loading in
percent, serving), logs one line with the namespace and ranks once every rank serves, then
waits for `shoal stop` (the registry's stop flag), SIGTERM or SIGINT, and tears the cluster
down (no actor, no placement group left) before exiting 0. A `shoal stop` during the launch
ends it the same way: the ranks started so far are torn down and the command exits 0. With `--port`, it also serves the
OpenAI API (`shoal.deploy.openai`) from a thread of this process while the cluster runs.
With `--autoscale`, the cluster's autoscaler (`shoal.cluster.autoscaler`) starts once the
ranks serve and sizes it between `--min-data-parallel-size` and `--max-data-parallel-size`.
A mistake found before the launch (`shoal.deploy.preflight`: a bad size, an unservable
model, a port in use, bad autoscaling bounds) ends the command with one line and exit code 2.
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
from typing import Any

import ray

from shoal.cluster.autoscale_policy import AutoscalerConfig
from shoal.cluster.autoscaler import start_autoscaler
from shoal.cluster.launch import (
    READY_TIMEOUT_S,
    ClusterExistsError,
    ClusterHandle,
    EngineStartError,
    LaunchOptions,
    LaunchStopped,
    check_launchable,
    launch,
)
from shoal.cluster.placement import RankResources
from shoal.cluster.ranks import check_rank_resources
from shoal.deploy.autoscale import add_autoscale_args, autoscaler_config, launch_size
from shoal.deploy.flags import HelpFormatter, add_vllm_compat_args
from shoal.deploy.openai.generation_config import load_generation_defaults
from shoal.deploy.openai.lora import serve_lora_modules
from shoal.deploy.openai.server import (
    FrontEndConfig,
    FrontEndThread,
    add_http_args,
    front_end_config,
)
from shoal.deploy.preflight import (
    bind_http_port,
    check_model_here,
    check_model_on_cluster,
    check_not_negative,
    local_path_or_refusal,
)
from shoal.deploy.progress import configure_logging
from shoal.deploy.ray_connection import add_ray_args, connect_ray
from shoal.engine.config import EngineConfig, add_engine_cli_args, engine_kwargs_from_cli
from shoal.engine.model_arch import describe_architectures

logger = logging.getLogger("shoal.serve")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `shoal serve`: model, cluster layout, and every engine flag."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory or .gguf file (or give --model)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="local Hugging Face directory or .gguf file, of one of these architectures: "
        + describe_architectures().replace("%", "%%"),
    )
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
    add_autoscale_args(parser)
    parser.add_argument(
        "--detached",
        action="store_true",
        help="return once the cluster serves, leaving it running (stop it with `shoal stop`)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=READY_TIMEOUT_S,
        metavar="S",
        help="how long every rank has to load the model and serve",
    )
    add_engine_cli_args(parser, skip=("data_parallel_rank",))
    add_vllm_compat_args(parser)


def add_rank_args(parser: argparse.ArgumentParser) -> None:
    """What each rank reserves and how ranks are placed (`shoal serve`, `shoal scale`)."""
    parser.add_argument(
        "--num-cpus-per-rank", type=float, default=1.0, help="CPUs each rank reserves"
    )
    parser.add_argument(
        "--num-gpus-per-rank",
        type=float,
        default=None,
        help="GPUs each rank reserves (default: one per --tensor-parallel-size worker if the "
        "cluster has GPUs, else 0; another value with -tp N > 1 is refused)",
    )
    parser.add_argument(
        "--placement-strategy",
        choices=("pack", "spread"),
        default="pack",
        help="pack: ranks on as few nodes as fit; spread: across as many nodes as possible",
    )


def rank_resources(args: argparse.Namespace, tensor_parallel_size: int = 1) -> RankResources:
    """The reservation of `add_rank_args`' flags (after ray.init: the default looks for GPUs):
    a rank of N tensor-parallel workers reserves N GPUs, or at least N CPUs without GPUs."""
    num_gpus = args.num_gpus_per_rank
    if num_gpus is None:
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        num_gpus = float(tensor_parallel_size) if has_gpus else 0.0
    num_cpus = args.num_cpus_per_rank
    if not num_gpus:
        num_cpus = max(num_cpus, float(tensor_parallel_size))
    return RankResources(num_cpus=num_cpus, num_gpus=num_gpus)


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


def model_of(args: argparse.Namespace) -> str:
    """The model of the positional MODEL or `--model` (vLLM takes either).

    Raises:
        ValueError: neither given, or both given and different.
    """
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag} and --model {args.model}")
    model = args.model_tag or args.model
    if not model:
        raise ValueError("no model given: `shoal serve PATH` or `--model PATH`")
    return str(model)


def serve_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields of `shoal serve`'s flags. vLLM's `--enforce-eager`, a no-op for
    shoal's engine, reaches vLLM's engine as its engine argument."""
    kwargs = engine_kwargs_from_cli(args)
    if kwargs.get("engine") == "vllm" and getattr(args, "enforce_eager", False):
        kwargs["vllm_engine_args"] = {"enforce_eager": True, **kwargs["vllm_engine_args"]}
    return kwargs


def run(args: argparse.Namespace) -> int:
    """Runs `shoal serve` with parsed arguments. Returns the exit code."""
    try:
        check_not_negative(args)
        args.model = model_of(args)
        autoscaling = autoscaler_config(args)
        kwargs = serve_engine_kwargs(args)
        if autoscaling is not None:
            size = kwargs.get("data_parallel_size", 1)
            kwargs["data_parallel_size"] = launch_size(autoscaling, size)
        config = EngineConfig.from_kwargs(args.model, **kwargs)
    except (ValueError, TypeError) as e:
        logger.error("shoal serve: %s", e)
        return 2
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
        # A Hub id is downloaded here first: this node reads its config and tokenizer (the
        # ranks resolve the id on their own nodes, finding this snapshot on this one).
        model_path = local_path_or_refusal(config)
        check_model_here(model_path, config.rank_engine.engine)
        check_launchable(config)
        if args.num_gpus_per_rank is not None:
            check_rank_resources(config, RankResources(num_gpus=args.num_gpus_per_rank))
        http_config = None if args.port is None else front_end_config(args, args.port)
        if http_config is not None:  # the front end reads these again as it starts
            load_generation_defaults(http_config.generation_config, model_path)
            serve_lora_modules(http_config.lora_modules, config.lora, ())
        # Held from now on, so a port in use fails before anything launches.
        sock = None if args.port is None else bind_http_port(args.host, args.port)
    except ValueError as e:
        logger.error("shoal serve: %s", e)
        return 2
    try:
        return _launch_and_serve(args, config, model_path, http_config, sock, autoscaling)
    finally:
        if sock is not None:
            sock.close()


def _launch_and_serve(
    args: argparse.Namespace,
    config: EngineConfig,
    model_path: str,
    http_config: FrontEndConfig | None,
    sock: socket.socket | None,
    autoscaling: AutoscalerConfig | None = None,
) -> int:
    stop = _StopSignals()
    try:
        connect_ray(args.address, args.namespace, can_start_local=True)
        try:
            check_model_on_cluster(model_path)
        except ValueError as e:
            logger.error("shoal serve: %s", e)
            return 2
        stop.install()  # after ray.init, which installs a SIGTERM handler of its own
        options = LaunchOptions(
            rank_resources(args, config.parallel.tensor_parallel_size),
            args.placement_strategy,
            host=args.data_parallel_address,
            detached=args.detached,
            ready_timeout_s=args.ready_timeout,
        )
        server = f"{socket.gethostname()}:{os.getpid()}"
        handle = launch(config, options, namespace=args.namespace, served_by=server)
        stop.is_serving = True
        if autoscaling is not None:
            start_autoscaler(
                handle, autoscaling, detached=args.detached, ready_timeout_s=args.ready_timeout
            )
    except (ClusterExistsError, ConnectionError) as e:
        logger.error("shoal serve: %s", e)
        return 1
    except EngineStartError as e:  # the engine's traceback, not this process's
        logger.error("%s\n%s", e, e.__cause__)
        return 1
    except KeyboardInterrupt:
        logger.info("interrupted while launching; nothing is left running")
        return 130
    except LaunchStopped as e:
        logger.info("%s; nothing is left running", e)
        return 0
    except Exception:
        logger.exception("launch failed")
        return 1
    return _serve_until_stopped(args, handle, stop, http_config, sock)


def _serve_until_stopped(
    args: argparse.Namespace,
    handle: ClusterHandle,
    stop: _StopSignals,
    http_config: FrontEndConfig | None,
    sock: socket.socket | None,
) -> int:
    """Serves the launched cluster (and its front end) until `shoal stop` or a signal, then
    tears it down; a detached cluster is left running at once. Returns the exit code."""
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
        if args.detached:  # nobody serves it from now on: `shoal stop` tears it down itself
            ray.get(handle.registry.set_served_by.remote(None))
            logger.info("detached: stop it with `shoal stop --namespace %s`", args.namespace)
            return 0
        front_end = _start_front_end(http_config, sock)
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


def _start_front_end(
    config: FrontEndConfig | None, sock: socket.socket | None
) -> FrontEndThread | None:
    """The HTTP front end of `--port`, serving from a thread of this process."""
    if config is None:
        return None
    front_end = FrontEndThread(config, sock)
    front_end.start()
    return front_end


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m shoal.deploy.serve ARGS`, the same as `shoal serve ARGS`."""
    parser = argparse.ArgumentParser(
        prog="shoal serve", description=__doc__, formatter_class=HelpFormatter
    )
    add_serve_args(parser)
    configure_logging()
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
