"""Running a front end: uvicorn serving `build_app` over an `AsyncLLM` attached by namespace.

    shoal api-server --namespace NS [--host H] [--port P] [--api-key KEY] [--served-model-name N]

attaches a front end to a running cluster (any node, any number of them, coming and going
while the engines run). `shoal serve --port P` runs the same front end in a thread of the
serving process (`FrontEndThread`). The API key comes from `--api-key`, else from the
`SHOAL_API_KEY` environment variable (so a Kubernetes Secret can supply it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
from dataclasses import dataclass
from types import FrameType

import uvicorn

from shoal.client.async_llm import AsyncLLM
from shoal.cluster.launch import attach
from shoal.deploy.openai.app import build_app
from shoal.deploy.openai.state import ServerState

logger = logging.getLogger("shoal.api_server")

API_KEY_ENV = "SHOAL_API_KEY"
DEFAULT_PORT = 8000
# How long a stopping front end lets open streams run before it closes them.
GRACEFUL_SHUTDOWN_S = 5
# How long a front end waits for a cluster still being launched until one of its ranks serves.
ATTACH_READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FrontEndConfig:
    """Where and how one front end serves."""

    namespace: str
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    served_model_name: str | None = None
    data_parallel_address: str | None = None  # this node's address as the engines reach it
    # How ranks that a resize asked of this front end adds are started: `shoal serve --port`
    # starts them as it launched the others; any other front end, detached.


def add_http_args(parser: argparse.ArgumentParser, *, port_default: int | None) -> None:
    """--host, --port, --api-key, --served-model-name: vLLM's names."""
    parser.add_argument(
        "--host", default="0.0.0.0", help="HTTP bind address of the OpenAI API (default: all)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=port_default,
        help="HTTP port of the OpenAI API"
        + (f" (default {port_default})" if port_default else " (default: no HTTP front end)"),
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV}, if set)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: --model)"
    )


def front_end_config(args: argparse.Namespace, port: int) -> FrontEndConfig:
    return FrontEndConfig(
        namespace=args.namespace,
        host=args.host,
        port=port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        served_model_name=args.served_model_name,
        data_parallel_address=args.data_parallel_address,
    )


async def serve_front_end(
    config: FrontEndConfig, should_exit: threading.Event | None = None
) -> None:
    """Attaches to the cluster and serves HTTP until uvicorn exits (SIGINT/SIGTERM in the main
    thread) or `should_exit` is set; then detaches, leaving the engines running."""
    llm = await AsyncLLM.connect(
        config.namespace,
        host=config.data_parallel_address,
        name=f"api-server {config.host}:{config.port}",
        ready_timeout_s=ATTACH_READY_TIMEOUT_S,
    )
    try:
        handle = await asyncio.to_thread(attach, config.namespace)
        name = config.served_model_name or llm.config.model.model
        state = ServerState.make(llm, name, config.api_key, handle.registry)
        uv_config = uvicorn.Config(
            build_app(state),
            host=config.host,
            port=config.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(uv_config)
        watcher = asyncio.create_task(_exit_when_set(server, should_exit))
        logger.info(
            "OpenAI API of %s at http://%s:%d/v1 (namespace %s)",
            name,
            config.host,
            config.port,
            config.namespace,
        )
        try:
            await server.serve()
        finally:
            watcher.cancel()
    finally:
        await llm.shutdown()


async def _exit_when_set(server: uvicorn.Server, event: threading.Event | None) -> None:
    if event is None:
        return
    while not event.is_set():
        await asyncio.sleep(0.2)
    server.should_exit = True


class FrontEndThread:
    """A front end on a thread of its own (its own event loop), for `shoal serve --port`."""

    def __init__(self, config: FrontEndConfig) -> None:
        self.config = config
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shoal-front-end", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = GRACEFUL_SHUTDOWN_S + 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            asyncio.run(serve_front_end(self.config, self._stop))
        except BaseException as e:
            self.error = e
            logger.exception("the HTTP front end failed")


def run(args: argparse.Namespace) -> int:
    """`shoal api-server`: serves until SIGINT/SIGTERM. Returns the exit code."""
    from shoal.deploy.serve import connect_ray

    try:
        connect_ray(args.address, args.namespace, can_start_local=False)
    except ConnectionError as e:
        logger.error("no Ray cluster at %r: %s", args.address, e)
        return 1
    # uvicorn handles SIGTERM/SIGINT while it serves, then re-raises the signal to the handler
    # it found: ours ends the process with 0 once the front end has detached (Ray's, installed
    # by ray.init, would exit with 15).
    signal.signal(signal.SIGTERM, _exit_quietly)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve_front_end(front_end_config(args, args.port)))
        except Exception as e:
            logger.error("shoal api-server: %s", e)
            return 1
    return 0


def _exit_quietly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def add_api_server_args(parser: argparse.ArgumentParser) -> None:
    from shoal.deploy.serve import add_ray_args

    add_ray_args(parser)
    add_http_args(parser, port_default=DEFAULT_PORT)
    parser.add_argument(
        "--data-parallel-address",
        default=None,
        help="this node's address as the engines reach it (default: Ray's node IP)",
    )
