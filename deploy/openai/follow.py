"""A front end that follows its cluster: waits for it to serve, notices when it is gone, and
attaches to the next cluster served in its namespace.

One `ClusterFollower` runs beside each `shoal api-server` (not beside `shoal serve --port`,
whose front end ends with its cluster). Its states:

    WAITING   (before HTTP serves) polls the namespace until a rank of a cluster there is
              READY, logging what it sees every `WAIT_LOG_S`; no rank within
              `--ready-timeout`: the front end exits 1 with what it saw last
    ATTACHED  serves; pings the registry each `PING_INTERVAL_S`. A failed ping is a restart
              (Ray brings the registry back under the same handle: nothing to do) or the
              end of the cluster (its registry's name is free, or held by another actor)
    DETACHED  closes the client; every request that needs a cluster gets a 503 saying why,
              `/health` too. With `--exit-with-cluster` the front end exits 0 here; else it
              waits, with no deadline, as in WAITING (while HTTP serves) and is ATTACHED
              again once a new cluster of the namespace has a READY rank.

The follower only reads the control plane (the registry's name and its answers); requests
never wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from shoal.actors.names import REGISTRY_NAME
from shoal.actors.registry import RegistryHandle
from shoal.cluster.launch import ClusterNotFoundError, attach, registry_answers_again
from shoal.deploy.openai.state import ServerState

logger = logging.getLogger("shoal.api_server")

# How often an attached front end asks whether its cluster's registry still answers.
PING_INTERVAL_S = 1.0
# A ping slower than this is a busy registry, not a gone one.
_PING_TIMEOUT_S = 5.0
# How often a waiting front end looks at the namespace.
_POLL_S = 0.5
# How often it says what it sees: while the command waits, and while it serves 503s.
WAIT_LOG_S = 10.0
FOLLOW_LOG_S = 60.0
# Closing the client of a cluster that is gone: it has nobody to wait for, but never hang.
_CLOSE_TIMEOUT_S = 10.0
# After an attach that failed (a rank went away meanwhile): how long until the next try.
_RETRY_S = 2.0


async def wait_until_served(namespace: str, timeout_s: float | None, log_every_s: float) -> None:
    """Returns once a cluster in `namespace` has a rank that serves; says what it sees at once
    and then every `log_every_s`.

    Raises:
        TimeoutError: no rank served within `timeout_s` (None: no limit); the message says
            what the namespace held last (no cluster, and where clusters run; ranks starting).
    """
    start = time.monotonic()
    next_log = start
    while True:
        is_serving, seen = await asyncio.to_thread(_look, namespace)
        if is_serving:
            return
        waited = time.monotonic() - start
        is_over = timeout_s is not None and waited >= timeout_s
        if is_over or time.monotonic() >= next_log:
            if seen is None:  # no cluster: where clusters do run hints at a mistyped name
                elsewhere = await asyncio.to_thread(_namespaces_with_clusters)
                where = f"; clusters run in: {', '.join(map(repr, elsewhere))}" if elsewhere else ""
                seen = f"no shoal cluster runs in namespace {namespace!r}{where}"
            if is_over:
                raise TimeoutError(f"{seen} (waited {timeout_s:.0f} s: --ready-timeout)")
            limit = "" if timeout_s is None else f" of {timeout_s:.0f}"
            logger.info("waiting for a cluster to serve (%.0f%s s): %s", waited, limit, seen)
            next_log += log_every_s
        await asyncio.sleep(_POLL_S)


def _look(namespace: str) -> tuple[bool, str | None]:
    """Whether a rank of the cluster in `namespace` serves, and what the namespace holds
    (None: no cluster)."""
    try:
        handle = attach(namespace)
    except ClusterNotFoundError:
        return False, None
    try:
        status: dict[str, Any] = ray.get(handle.registry.status.remote(), timeout=_PING_TIMEOUT_S)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False, f"the registry of the cluster in namespace {namespace!r} does not answer"
    states = Counter(str(r["state"]) for r in status["ranks"])
    if states.get("ready"):
        return True, f"{states['ready']} ranks serve"
    if status.get("stopping"):
        return False, f"the cluster in namespace {namespace!r} is stopping"
    ranks = ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "none started"
    return False, (
        f"the cluster in namespace {namespace!r} has no serving rank yet "
        f"({status['data_parallel_size']} ranks: {ranks})"
    )


def _namespaces_with_clusters() -> list[str]:
    """The namespaces where a shoal cluster's registry runs (a mistyped name's neighbours)."""
    with contextlib.suppress(Exception):  # only a hint: never fail the wait for it
        actors = ray.util.list_named_actors(all_namespaces=True)
        return sorted({a["namespace"] for a in actors if a["name"] == REGISTRY_NAME})
    return []


class ClusterFollower:
    """Keeps one front end's `ServerState` bound to whichever cluster serves its namespace.

    Args:
        state: the front end's state, bound to a cluster already.
        namespace: the cluster's Ray namespace.
        attach_again: connects to the namespace's cluster (one rank serves it) and binds the
            state to it; raises if it cannot.
        exit_with_cluster: when the cluster is gone, call `exit` instead of waiting for the next.
        exit: ends the front end (uvicorn's `should_exit`).
    """

    def __init__(
        self,
        state: ServerState,
        namespace: str,
        attach_again: Callable[[], Awaitable[None]],
        *,
        exit_with_cluster: bool,
        exit: Callable[[], None],
    ) -> None:
        self.state = state
        self.namespace = namespace
        self._attach_again = attach_again
        self._exit_with_cluster = exit_with_cluster
        self._exit = exit

    async def run(self) -> None:
        """ATTACHED → DETACHED → WAITING → ATTACHED ..., until cancelled or told to exit."""
        while True:
            registry = self.state.registry
            assert registry is not None, "the follower starts once the state is bound"
            await self._wait_until_gone(registry)
            ns = self.namespace
            llm = self.state.detach_cluster(
                f"the cluster in namespace {ns!r} is gone (stopped?); this front end attaches "
                "again once a cluster serves there"
            )
            if llm is not None:
                with contextlib.suppress(Exception):  # its cluster is gone: nothing to tell
                    await asyncio.wait_for(llm.aclose(), _CLOSE_TIMEOUT_S)
            if self._exit_with_cluster:
                logger.warning(
                    "the cluster in namespace %r is gone; exiting (--exit-with-cluster)", ns
                )
                self._exit()
                return
            logger.warning(
                "the cluster in namespace %r is gone; answering 503 until a cluster serves there "
                "again",
                ns,
            )
            await self._reattach()

    async def _wait_until_gone(self, registry: RegistryHandle) -> None:
        """Returns when `registry` is gone for good: dead and not restarted, or replaced."""
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            try:
                await asyncio.wait_for(
                    asyncio.wrap_future(registry.ping.remote().future()), _PING_TIMEOUT_S
                )
                continue
            except TimeoutError:
                continue  # busy, not gone
            except ray.exceptions.RayActorError:
                pass
            except ray.exceptions.RayError as e:  # Ray itself in trouble: look again later
                logger.warning("cannot reach the cluster's registry: %s", e)
                continue
            if not await asyncio.to_thread(
                registry_answers_again,
                registry,
                give_up=lambda: _is_replaced_or_gone(self.namespace, registry),
            ):
                return

    async def _reattach(self) -> None:
        """Waits, with no deadline, for the namespace to be served again, then attaches."""
        while True:
            try:
                await wait_until_served(self.namespace, None, FOLLOW_LOG_S)
                await self._attach_again()
            except Exception as e:  # a rank went away meanwhile, Ray is restarting, ...
                logger.warning(
                    "could not attach to the cluster in namespace %r: %s; trying again",
                    self.namespace,
                    e,
                )
                await asyncio.sleep(_RETRY_S)
                continue
            logger.info("attached again to the cluster in namespace %r", self.namespace)
            return


def _is_replaced_or_gone(namespace: str, registry: RegistryHandle) -> bool:
    """Whether the registry's name in `namespace` is free or another actor's."""
    try:
        current = ray.get_actor(REGISTRY_NAME, namespace=namespace)
    except ValueError:
        return True
    return bool(current != registry)
