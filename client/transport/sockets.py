"""A client's data-plane sockets: the input ROUTER to every engine and the bound output PULL.

It owns how they are made (CURVE, heartbeats, high-water marks, where the PULL binds) and how a
HELLO is sent while a connection is still being set up; `MPClient` decides what goes over them.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from typing import Any

import zmq

from shoal.client.transport.background_resources import CLOSE_LINGER_MS, BackgroundResources
from shoal.client.transport.engine_set import EngineIdentity
from shoal.engine.core.curve import ClientCurve

# ZMTP heartbeats on the input connections, so a silent engine host is noticed too.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000


def make_input_socket(
    ctx: zmq.Context, curve: ClientCurve | None, resources: BackgroundResources
) -> zmq.Socket:
    """The ROUTER that addresses every engine by its identity (registered for closing)."""
    socket = ctx.socket(zmq.ROUTER)
    if curve is not None:
        curve.secure_input_socket(socket)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
    socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    resources.input_socket = socket
    return socket


def make_output_socket(
    ctx: zmq.Context,
    curve: ClientCurve | None,
    resources: BackgroundResources,
    host: str,
    transport: str,
) -> tuple[zmq.Socket, str]:
    """The PULL every engine pushes this client's outputs to, and the address it bound.

    Raises:
        ValueError: `transport` is neither "tcp" nor "ipc".
    """
    socket = ctx.socket(zmq.PULL)
    if curve is not None:
        curve.secure_output_socket(socket)
    # The default receive HWM: unbounded, the IO thread outruns the reader and costs it
    # a third of its throughput; beyond it, outputs wait in the engine's PUSH queue.
    socket.setsockopt(zmq.LINGER, 0)
    resources.output_socket = socket
    if transport == "tcp":
        port = socket.bind_to_random_port(f"tcp://{host}")
        return socket, f"tcp://{host}:{port}"
    if transport == "ipc":
        path = f"{tempfile.gettempdir()}/shoal-client-{uuid.uuid4().hex}.sock"
        socket.bind(f"ipc://{path}")
        resources.ipc_path = path
        return socket, f"ipc://{path}"
    raise ValueError(f"transport must be 'tcp' or 'ipc', got {transport!r}")


def send_hello(
    router: zmq.Socket, identity: EngineIdentity, message: tuple[Any, ...], deadline: float
) -> None:
    """Sends HELLO, retrying while the ROUTER has no connection to the engine yet."""
    delay_s = 0.001
    while True:
        try:
            router.send_multipart((identity, *message), flags=zmq.NOBLOCK)
            return
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN) or time.monotonic() > deadline:
                raise
        time.sleep(delay_s)  # connection setup, not the data path
        delay_s = min(delay_s * 2, 0.05)
