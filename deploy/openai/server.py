"""Running a front end: uvicorn serving `build_app` over an `AsyncLLM` attached by namespace.

    shoal api-server --namespace NS [--host H] [--port P] [--api-key-file F] [--served-model-name N]

attaches a front end to a running cluster (any node, any number of them, coming and going
while the engines run). It waits up to `--ready-timeout` for a rank to serve, saying what it
sees, and then follows the namespace (`follow`): when the cluster stops it answers 503 until
the next one serves, or exits with `--exit-with-cluster`. `shoal serve --port P` runs the same
front end in a thread of the serving process (`FrontEndThread`), which ends with its cluster.

The API keys come from `--api-key-file` (one, or one per tenant: `tenants`; a file only its
owner reads, e.g. a mounted Kubernetes Secret), else `--api-key` (with a warning: it is
visible in `ps`, the Ray job's entrypoint and its log), else `SHOAL_API_KEY`; the admin key
(resizes, LoRA loads) likewise: `--admin-api-key-file`, `--admin-api-key`, `SHOAL_ADMIN_API_KEY`,
else the API key. No key is logged. Requests are bounded by `limits` and `connections`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

import uvicorn

from shoal.actors.registry import RegistryHandle
from shoal.client.api.async_llm import AsyncLLM
from shoal.client.routing.lb_policy import ROUTING_POLICIES, CacheAwarePolicy, make_policy
from shoal.client.routing.migration import DEFAULT_MIGRATION_LIMIT
from shoal.cluster.launch import attach
from shoal.deploy.openai import admission_gate
from shoal.deploy.openai.app import build_app
from shoal.deploy.openai.chat import load_chat_template
from shoal.deploy.openai.connections import connection_cap, guarded_protocol, quiet_loop_errors
from shoal.deploy.openai.follow import WAIT_LOG_S, ClusterFollower, wait_until_served
from shoal.deploy.openai.generation_config import load_generation_defaults
from shoal.deploy.openai.limits import (
    FrontEndLimits,
    add_limit_args,
    limits_from_args,
    non_negative_float,
    non_negative_int,
)
from shoal.deploy.openai.lora import LoRAModule, add_lora_args, serve_lora_modules
from shoal.deploy.openai.state import ServerState
from shoal.deploy.openai.tenants import TenantTable, load_tenants, read_key
from shoal.deploy.openai.tools import ToolCallConfig, add_tool_args, tool_config_from_args
from shoal.deploy.preflight import bind_http_port, check_not_negative
from shoal.deploy.ray_connection import add_ray_args, connect_ray
from shoal.engine.core.connection_gate import raise_open_file_limit
from shoal.engine.loader.hub import local_model_path

logger = logging.getLogger("shoal.api_server")

API_KEY_ENV = "SHOAL_API_KEY"
ADMIN_API_KEY_ENV = "SHOAL_ADMIN_API_KEY"
DEFAULT_PORT = 8000
# After a cluster of the namespace serves again: how long its attach may take.
_REATTACH_S = 60.0
# How long a stopping front end lets open streams run before it closes them.
GRACEFUL_SHUTDOWN_S = 5
# How long `shoal serve --port`'s front end waits for a rank of the cluster just launched.
ATTACH_READY_TIMEOUT_S = 60.0
# `shoal api-server --ready-timeout`: it may start before its cluster, so as long as a launch
# gives its ranks to load the model.
API_SERVER_READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class FrontEndConfig:
    """Where and how one front end serves."""

    namespace: str
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    api_key: str | None = field(default=None, repr=False)
    # The names the API answers to (the first is the one it reports); default: the model path.
    served_model_names: tuple[str, ...] = ()
    data_parallel_address: str | None = None  # this node's address as the engines reach it
    admin_api_key: str | None = field(default=None, repr=False)  # default: api_key
    limits: FrontEndLimits = field(default_factory=FrontEndLimits)
    tool_calls: ToolCallConfig = field(default_factory=ToolCallConfig)
    routing_policy: str = "cache-aware"  # `shoal.client.routing.lb_policy.make_policy`
    lora_load_cost: float | None = None  # the cache-aware policy's; None: its default
    # How often a request may move off a failed rank (`shoal.client.routing.migration`).
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    chat_template: str | None = None  # overrides the tokenizer's (`load_chat_template`)
    uvicorn_log_level: str = "warning"
    generation_config: str = "vllm"  # `load_generation_defaults`
    ready_timeout_s: float = ATTACH_READY_TIMEOUT_S  # for a rank of the cluster to serve
    # Follow the namespace (`follow`): attach to the next cluster served there after this one.
    follow_cluster: bool = False
    exit_with_cluster: bool = False  # following: exit when the cluster is gone instead
    tenants: TenantTable | None = field(default=None, repr=False)  # None: `api_key` alone
    admission: admission_gate.AdmissionConfig = field(
        default_factory=admission_gate.AdmissionConfig
    )
    lora_modules: tuple[LoRAModule, ...] = ()  # `--lora-modules`: served from the start


def add_http_args(parser: argparse.ArgumentParser, *, port_default: int | None) -> None:
    """The front end's flags, in groups: where it listens, its keys (one per tenant), what it
    serves, how it routes, then its limits, tenant admission and tool calls. vLLM's names."""
    _add_listen_args(parser.add_argument_group("HTTP front end"), port_default)
    _add_key_args(parser.add_argument_group("API keys"))
    _add_serving_args(group := parser.add_argument_group("what the front end serves"))
    add_lora_args(group)
    _add_routing_args(parser.add_argument_group("routing"))
    add_limit_args(parser.add_argument_group("request and connection limits"))
    admission_gate.add_admission_args(parser.add_argument_group("admission by tenant"))
    add_tool_args(parser.add_argument_group("tool calls"))


def _add_listen_args(group: argparse._ArgumentGroup, port_default: int | None) -> None:
    """--host, --port."""
    group.add_argument(
        "--host", default="0.0.0.0", help="HTTP bind address of the OpenAI API (default: all)"
    )
    group.add_argument(
        "--port",
        type=int,
        default=port_default,
        help="HTTP port of the OpenAI API"
        + (f" (default {port_default})" if port_default else " (default: no HTTP front end)"),
    )


def _add_key_args(group: argparse._ArgumentGroup) -> None:
    """--api-key(-file), --admin-api-key(-file)."""
    group.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require `Authorization: Bearer KEY` on /v1/* and /tokenize, KEY read from PATH "
        "(kept out of `ps` and the job's log, unlike --api-key); one key, or one tenant per "
        "line: `NAME KEY [weight=W] [max_concurrency=N] [max_queued=N]`",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help=f"the API key itself (visible in `ps`: prefer --api-key-file; default: "
        f"${API_KEY_ENV}, if set)",
    )
    group.add_argument(
        "--admin-api-key-file",
        default=None,
        metavar="PATH",
        help="the key of the resize endpoints, read from PATH (default: the one API key)",
    )
    group.add_argument(
        "--admin-api-key",
        default=None,
        help=f"the admin key itself (visible in `ps`; default: ${ADMIN_API_KEY_ENV}, else the "
        "API key)",
    )


def _add_serving_args(group: argparse._ArgumentGroup) -> None:
    """--served-model-name, --chat-template, --generation-config, --uvicorn-log-level."""
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names the API answers to; the first is the one it reports (default: the "
        "model path)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, used instead of the tokenizer's "
        "(default: the tokenizer's)",
    )
    group.add_argument(
        "--generation-config",
        default="vllm",
        metavar="{vllm,auto,FOLDER}",
        help="sampling defaults for what a request leaves unset: vllm: none (default); auto: "
        "the model's generation_config.json; FOLDER: the generation_config.json in FOLDER",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="the HTTP server's log level (default: warning)",
    )


def _add_routing_args(group: argparse._ArgumentGroup) -> None:
    """--routing-policy, --routing-lora-load-cost, --migration-limit."""
    group.add_argument(
        "--routing-policy",
        choices=ROUTING_POLICIES,
        default="cache-aware",
        help="how the front end picks a rank: cache-aware (default: the uncached prefill plus "
        "the rank's load, cheapest wins), least-loaded, or round-robin",
    )
    group.add_argument(
        "--routing-lora-load-cost",
        type=non_negative_float,
        default=None,
        metavar="TOKENS",
        help="with --enable-lora, what the cache-aware policy adds for a rank that must load "
        "the request's adapter, in prompt tokens of prefill (twice that where its slots are "
        f"full); 0 routes as if adapters cost nothing (default {CacheAwarePolicy.lora_load_cost:.0f})",
    )
    group.add_argument(
        "--migration-limit",
        type=non_negative_int,
        default=DEFAULT_MIGRATION_LIMIT,
        metavar="N",
        help="how often one request may move to another rank when its rank dies or hangs, "
        "continuing from the tokens already generated; past it, or with 0, the request "
        f"fails (default {DEFAULT_MIGRATION_LIMIT})",
    )


def front_end_config(args: argparse.Namespace, port: int) -> FrontEndConfig:
    """Raises ValueError: a key file that cannot be read, is empty or bad; a bad limit."""
    if args.api_key_file is not None:
        tenants = load_tenants(args.api_key_file)
    else:
        tenants = TenantTable.single(read_key(None, args.api_key, "--api-key", API_KEY_ENV))
    return FrontEndConfig(
        namespace=args.namespace,
        host=args.host,
        port=port,
        api_key=tenants.only_key,
        tenants=tenants,
        admission=admission_gate.admission_config_from_args(args),
        served_model_names=tuple(args.served_model_name or ()),
        data_parallel_address=args.data_parallel_address,
        admin_api_key=read_key(
            args.admin_api_key_file, args.admin_api_key, "--admin-api-key", ADMIN_API_KEY_ENV
        ),
        limits=limits_from_args(args),
        tool_calls=tool_config_from_args(args),
        routing_policy=args.routing_policy,
        lora_load_cost=args.routing_lora_load_cost,
        migration_limit=args.migration_limit,
        chat_template=load_chat_template(args.chat_template),
        uvicorn_log_level=args.uvicorn_log_level,
        generation_config=args.generation_config,
        lora_modules=tuple(args.lora_modules or ()),
    )


async def serve_front_end(
    config: FrontEndConfig,
    should_exit: threading.Event | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Attaches to the cluster and serves HTTP until uvicorn exits (SIGINT/SIGTERM in the main
    thread), `should_exit` is set, or (`exit_with_cluster`) the cluster is gone; then
    detaches, leaving the engines running.

    Raises:
        TimeoutError: no rank of a cluster in the namespace served within `ready_timeout_s`.
    """
    deadline = time.monotonic() + config.ready_timeout_s
    if config.follow_cluster:
        await wait_until_served(config.namespace, config.ready_timeout_s, WAIT_LOG_S)
    llm, registry = await _connect(config, deadline)
    state = ServerState(
        None,
        _served_names(config, llm)[0],
        config.api_key,
        admin_api_key=config.admin_api_key or config.api_key,
        limits=config.limits,
        tool_calls=config.tool_calls,
        tenants=config.tenants,
        admission_config=config.admission,
    )
    _bind(state, config, llm, registry)
    try:
        raise_open_file_limit()
        quiet_loop_errors(asyncio.get_running_loop())
        server = uvicorn.Server(_uvicorn_config(config, state))
        watcher = asyncio.create_task(_exit_when_set(server, should_exit))
        follower = _follow(config, state, server) if config.follow_cluster else None
        logger.info(
            "OpenAI API of %s at http://%s:%d/v1 (namespace %s)",
            state.model_name,
            config.host,
            config.port,
            config.namespace,
        )
        try:
            await server.serve(sockets=None if sock is None else [sock])
        finally:
            watcher.cancel()
            if follower is not None:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
            state.shutdown_pool()
            await state.grammar_sandbox.aclose()
    finally:
        if state.current_llm is not None:
            await state.current_llm.aclose()


def _uvicorn_config(config: FrontEndConfig, state: ServerState) -> uvicorn.Config:
    """uvicorn serving the app, its connections bounded (`connections`)."""
    limits = config.limits
    return uvicorn.Config(
        build_app(state),
        host=config.host,
        port=config.port,
        http=guarded_protocol(connection_cap(limits.max_connections), limits.http_read_timeout_s),
        timeout_keep_alive=limits.timeout_keep_alive_s,  # type: ignore[arg-type]
        log_level=config.uvicorn_log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def _follow(
    config: FrontEndConfig, state: ServerState, server: uvicorn.Server
) -> asyncio.Task[None]:
    """Follows the namespace (`follow`): attaches to the next cluster served there, or (with
    `exit_with_cluster`) stops the server once this one is gone."""

    async def attach_again() -> None:
        _bind(state, config, *await _connect(config, time.monotonic() + _REATTACH_S))

    def exit_server() -> None:
        server.should_exit = True

    follower = ClusterFollower(
        state,
        config.namespace,
        attach_again,
        exit_with_cluster=config.exit_with_cluster,
        exit=exit_server,
    )
    return asyncio.create_task(follower.run())


async def _connect(config: FrontEndConfig, deadline: float) -> tuple[AsyncLLM, RegistryHandle]:
    """A client of the namespace's cluster, and its registry's handle.

    Raises:
        ClusterNotFoundError, TimeoutError: no cluster, or no rank serving, by `deadline`.
    """
    llm = await AsyncLLM.connect(
        config.namespace,
        host=config.data_parallel_address,
        name=f"api-server {config.host}:{config.port}",
        policy=make_policy(config.routing_policy, lora_load_cost=config.lora_load_cost),
        ready_timeout_s=max(1.0, deadline - time.monotonic()),
        migration_limit=config.migration_limit,
    )
    try:
        handle = await asyncio.to_thread(attach, config.namespace)
    except BaseException:
        await llm.aclose()
        raise
    return llm, handle.registry


def _served_names(config: FrontEndConfig, llm: AsyncLLM) -> tuple[str, ...]:
    return config.served_model_names or (llm.config.model.model,)


def _bind(
    state: ServerState, config: FrontEndConfig, llm: AsyncLLM, registry: RegistryHandle
) -> None:
    """Serves `llm`'s cluster with the front end's settings from now on."""
    names = _served_names(config, llm)
    if config.chat_template is not None:
        llm.tokenizer.chat_template = config.chat_template
    state.served_model_names = names
    state.loras = serve_lora_modules(config.lora_modules, llm.config.lora, names)
    model = llm.config.model
    # `auto` reads the checkpoint's folder: a Hub id's snapshot (found again, as the tokenizer
    # was read from it).
    path = local_model_path(model) if config.generation_config == "auto" else model.model
    state.sampling_defaults = load_generation_defaults(config.generation_config, path)
    if state.sampling_defaults:
        logger.info("request defaults from generation_config.json: %s", state.sampling_defaults)
    state.bind_cluster(llm, registry, names[0])


async def _exit_when_set(server: uvicorn.Server, event: threading.Event | None) -> None:
    if event is None:
        return
    while not event.is_set():
        await asyncio.sleep(0.2)
    server.should_exit = True


class FrontEndThread:
    """A front end on a thread of its own (its own event loop), for `shoal serve --port`."""

    def __init__(self, config: FrontEndConfig, sock: socket.socket | None = None) -> None:
        self.config = config
        self._sock = sock  # bound already (`preflight.bind_http_port`), or None: uvicorn binds
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
            asyncio.run(serve_front_end(self.config, self._stop, self._sock))
        except BaseException as e:
            self.error = e
            logger.exception("the HTTP front end failed")


def run(args: argparse.Namespace) -> int:
    """`shoal api-server`: serves until SIGINT/SIGTERM. Returns the exit code."""
    try:  # before Ray: a bad flag or a port in use costs one line
        check_not_negative(args)
        config = dataclasses.replace(
            front_end_config(args, args.port),
            ready_timeout_s=args.ready_timeout,
            follow_cluster=True,
            exit_with_cluster=args.exit_with_cluster,
        )
        sock = bind_http_port(args.host, args.port)
    except ValueError as e:
        logger.error("shoal api-server: %s", e)
        return 2
    try:
        connect_ray(args.address, args.namespace, can_start_local=False)
    except ConnectionError as e:
        sock.close()
        logger.error("no Ray cluster at %r: %s", args.address, e)
        return 1
    # uvicorn handles SIGTERM/SIGINT while it serves, then re-raises the signal to the handler
    # it found: ours ends the process with 0 once the front end has detached (Ray's, installed
    # by ray.init, would exit with 15).
    signal.signal(signal.SIGTERM, _exit_quietly)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve_front_end(config, sock=sock))
        except Exception as e:
            logger.error("shoal api-server: %s", e)
            return 1
    return 0


def _exit_quietly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def add_api_server_args(parser: argparse.ArgumentParser) -> None:
    add_ray_args(parser)
    add_http_args(parser, port_default=DEFAULT_PORT)
    parser.add_argument(
        "--data-parallel-address",
        default=None,
        help="this node's address as the engines reach it (default: Ray's node IP)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=API_SERVER_READY_TIMEOUT_S,
        metavar="S",
        help="how long to wait for a rank of the namespace's cluster to serve before exiting 1 "
        "(progress is logged meanwhile)",
    )
    parser.add_argument(
        "--exit-with-cluster",
        action="store_true",
        help="exit when the cluster is gone (stopped) instead of answering 503 until a cluster "
        "serves the namespace again and attaching to it",
    )
