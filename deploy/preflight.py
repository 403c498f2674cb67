"""Checks `shoal serve` and `shoal api-server` make before anything starts, so that a mistake
costs one line and exit code 2 instead of a launch and an actor's traceback.

Order of a launch: flags (`check_not_negative`), a model given as a Hub id downloaded
(`local_path_or_refusal`), the model where this node can read it (`check_model_here`), the HTTP port (`bind_http_port` holds it until uvicorn serves on it),
then, once Ray is connected and before any actor starts, a model path that no node of a
one-node cluster has (`check_model_on_cluster`).
"""

from __future__ import annotations

import argparse
import os
import socket

import ray

from shoal.engine.config import EngineConfig
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import load_model_arch
from shoal.engine.loader.hub import local_model_path


def check_not_negative(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first numeric flag given a negative value."""
    for name, value in vars(args).items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {value}")


def local_path_or_refusal(config: EngineConfig) -> str:
    """The model's local path: itself, or a Hub id's snapshot, downloaded now.

    Raises:
        ValueError: the id names no repository or revision, or the Hub cannot be reached.
    """
    try:
        return local_model_path(config.model)
    except ModelLoadError as e:
        raise ValueError(str(e)) from e


def check_model_here(path: str, engine: str = "shoal") -> None:
    """Reads the checkpoint's metadata when this node has the path.

    A path this node lacks is left to `check_model_on_cluster` (other nodes may have it).
    vLLM's engine reads the checkpoints vLLM serves (far more architectures than shoal's
    loader), so with it only the path is checked here; its ranks check the model.

    Raises:
        ValueError: the path exists but is no servable checkpoint (missing config.json or
            weights, an unsupported architecture, a broken GGUF header).
    """
    if not os.path.exists(path) or engine == "vllm":
        return
    try:
        load_model_arch(path)
    except ModelLoadError as e:
        raise ValueError(f"cannot serve {path}: {e}") from e


def check_model_on_cluster(path: str) -> None:
    """After ray.init: a path no node has (this one is the cluster's only node) is refused.

    Raises:
        ValueError: the path does not exist and no other node could hold it.
    """
    if os.path.exists(path):
        return
    this_node = ray.get_runtime_context().get_node_id()
    others = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] != this_node]
    if not others:
        raise ValueError(
            f"model path {path} does not exist (give a local Hugging Face directory or .gguf file)"
        )


def bind_http_port(host: str, port: int) -> socket.socket:
    """Binds the front end's port now, so a port in use fails before anything launches.

    The socket is not listening yet (connections are refused rather than queued while the
    model loads); uvicorn listens on it once the front end serves.

    Raises:
        ValueError: the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind the HTTP port {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock
