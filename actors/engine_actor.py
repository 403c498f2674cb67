"""`EngineCoreActor`: a Ray actor hosting one `EngineCoreProc` (one DP rank).

The busy loop runs on its own thread, and the actor is threaded (created with
`max_concurrency > 1`), so control methods answer while the engine computes and the
registry's liveness call can stay pending. On start — including every restart by Ray — the
actor binds fresh sockets under a fresh identity and registers its endpoint with the registry.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import ray
from ray.actor import ActorProxy

from shoal.actors.engine_liveness import ENGINE_WATCH_GROUP, ENGINE_WATCH_GROUP_THREADS
from shoal.actors.membership import Membership, RankWorker, registration_token
from shoal.actors.names import REGISTRY_NAME
from shoal.actors.scale_state import EngineStart
from shoal.actors.start_progress import StartProgress
from shoal.actors.tp_worker import worker_launcher
from shoal.engine.config import EngineConfig
from shoal.engine.core.core_proc import EngineCoreProc
from shoal.engine.core.curve import CurveKeyPair, EngineKeys
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import load_model_arch
from shoal.engine.loader.hub import local_model_config, local_model_path
from shoal.engine.parallel.distributed import Rendezvous
from shoal.engine.parallel.elastic import ScaleNotice, ScalePlan
from shoal.engine.parallel.expert_parallel import ExpertPlacement, check_expert_parallel
from shoal.engine.protocol import EngineEndpoint
from shoal.engine.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from shoal.actors.registry import RegistryHandle

logger = logging.getLogger(__name__)

# Control calls that may be in flight at once (ready, health, keys, notices, shutdown); the
# registry's liveness watch runs in a group of its own (`ENGINE_WATCH_GROUP`).
ENGINE_ACTOR_MAX_CONCURRENCY = 4
ENGINE_ACTOR_CONCURRENCY_GROUPS = {ENGINE_WATCH_GROUP: ENGINE_WATCH_GROUP_THREADS}


ENGINE_ACTOR_PREFIX = "shoal-engine-"


def engine_actor_name(rank: int) -> str:
    return f"{ENGINE_ACTOR_PREFIX}{rank}"


class EngineCoreActor:
    """One engine rank.

    Args:
        config: the cluster's engine configuration (the rank is applied here).
        rank: this engine's data-parallel rank.
        namespace: the Ray namespace holding the registry.
        host: the address to bind; default: this node's IP.
        rank_keys: the rank's CURVE key pair, made at launch (the coordinator admits it
            before the engine starts); default a new one.

    Raises:
        KeyError: if the registry has not planned this rank.
        ModelLoadError, ValueError: if the engine cannot be built.
    """

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        namespace: str,
        host: str | None = None,
        rank_keys: CurveKeyPair | None = None,
    ) -> None:
        self.rank = rank
        registry: RegistryHandle = ray.get_actor(REGISTRY_NAME, namespace=namespace)
        progress = StartProgress(registry, rank)
        progress.report("finding the model and its tokenizer (a Hub id is downloaded here)")
        self._tokenizer = _load_tokenizer(config)
        node_ip = host or ray.util.get_node_ip_address()
        own_keys = rank_keys or CurveKeyPair.generate()
        progress.report("building the engine: weights, KV cache, sockets")
        self._busy_loop = EngineThread(lambda: self._build_proc(registry, node_ip, own_keys), rank)
        with progress.following_engine_logs():  # the weights' loading progress, in percent
            self.proc = self._busy_loop.wait_built()
        progress.report("registering its endpoint")
        progress.close()  # every report arrives before the registration
        self.endpoint: EngineEndpoint = self.proc.endpoint
        # The model and startup objects live as long as the process: keep them out of every
        # future garbage collection, which would otherwise scan them on the hot path.
        gc.collect()
        gc.freeze()
        self._busy_loop.serve()
        try:
            self.incarnation: int = self._register(registry, node_ip, own_keys)
        except BaseException:
            self._shutdown()
            raise
        logger.info(
            "rank %d serving at %s (incarnation %d)",
            rank,
            self.endpoint.input_address,
            self.incarnation,
        )

    def _build_proc(
        self, registry: RegistryHandle, node_ip: str, own_keys: CurveKeyPair
    ) -> EngineCoreProc:
        """The rank's engine, in the set it serves in now (a cluster resized since launch, or
        a resize that started this rank), as the registry keeps it: a restarted rank reads it
        again."""
        rank = self.rank
        membership: Membership = ray.get(registry.membership.remote())
        start: EngineStart = ray.get(registry.engine_start.remote(rank))
        config = start.config
        # A new identity per incarnation: clients must never confuse a restarted rank's
        # connection with the dead one's.
        identity = f"{rank}:{uuid.uuid4().hex[:12]}".encode()
        # Clients learn the public half of the rank's key pair (`shoal.engine.core.curve`) from
        # the endpoint it registers.
        keys = EngineKeys(own_keys, membership.client_keys, membership.coordinator_public_key)
        return EngineCoreProc(
            config.with_rank(rank),
            engine_index=rank,
            host=node_ip,
            identity=identity,
            stats_address=membership.stats_report_address,
            rendezvous=_ep_rendezvous(registry, config, node_ip, start.group_name, rank),
            keys=keys,
            joining=start.joining,
            worker_launcher=worker_launcher(),
        )

    def _register(self, registry: RegistryHandle, node_ip: str, own_keys: CurveKeyPair) -> int:
        """Registers the serving rank with the registry; returns its incarnation."""
        incarnation: int = ray.get(
            registry.register_engine.remote(
                self.endpoint, node_ip, registration_token(own_keys), self._workers(node_ip)
            )
        )
        # Clients that attached while this rank was starting: from now on the registry tells
        # this actor of every new one.
        membership: Membership = ray.get(registry.membership.remote())
        for client_index, public_key in membership.client_keys.items():
            self.proc.admit_client(client_index, public_key)
        return incarnation

    def _workers(self, node_ip: str) -> list[RankWorker]:
        """This incarnation's worker processes: the engine's own and its TP workers, which
        run on this node."""
        node_id = ray.get_runtime_context().get_node_id()
        engine = self.proc.engine_core
        return [
            RankWorker(w.tp_rank, w.pid, w.device, node_ip, node_id, engine.name)
            for w in engine.describe_workers()
        ]

    @ray.method
    def ready(self) -> EngineEndpoint:
        """Returns the endpoint once the engine is serving (the constructor has finished)."""
        return self.endpoint

    @ray.method
    def health(self) -> dict[str, Any]:
        """This incarnation's facts: rank, incarnation, identity, pid, whether the loop runs."""
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "identity": self.endpoint.identity.decode(),
            "is_busy_loop_alive": self._busy_loop.is_alive(),
            "pid": os.getpid(),
        }

    @ray.method
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, as read from this node's checkpoint at start: for drivers on
        nodes that have none (`AsyncLLM.connect`).

        Raises:
            ModelLoadError: the checkpoint holds no usable tokenizer.
        """
        if isinstance(self._tokenizer, ModelLoadError):
            raise self._tokenizer
        return self._tokenizer

    @ray.method
    def admit_client(self, client_index: int, public_key: bytes) -> None:
        """Lets the client holding `public_key` attach as `client_index` (the registry calls
        this for every client that attaches)."""
        self.proc.admit_client(client_index, public_key)

    @ray.method
    def revoke_client(self, client_index: int) -> None:
        """Takes a detached client's key out; a connection it still has is let go."""
        self.proc.revoke_client(client_index)

    @ray.method
    def set_stats_address(self, address: str) -> None:
        """Pushes stats reports to `address` from now on (the coordinator moved)."""
        self.proc.set_stats_address(address)

    # --- resizes (`shoal.cluster.elastic` drives them; `shoal.engine.parallel.elastic` has the states) --

    @ray.method
    def prepare_scale(self, plan: ScalePlan) -> None:
        """Starts staging this rank's part of `plan` while it keeps serving."""
        self.proc.elastic.prepare(plan)

    @ray.method
    def request_switch(self, epoch: int) -> None:
        """Lets the rank switch to resize `epoch` once staged, at a forward all ranks agree."""
        self.proc.elastic.request_switch(epoch)

    @ray.method
    def leave(self, epoch: int) -> None:
        """A dense rank leaves the set: its requests are released to their clients."""
        self.proc.elastic.leave(epoch)

    @ray.method
    def cancel_scale(self, epoch: int) -> None:
        """Resize `epoch` is rolled back on this rank."""
        self.proc.elastic.cancel(epoch)

    @ray.method
    def wait_switched(self, epoch: int, timeout_s: float) -> tuple[str, str] | None:
        """This rank's outcome of resize `epoch` (see `SwitchOutcome`), or None at the timeout."""
        return self.proc.elastic.wait(epoch, timeout_s)

    @ray.method
    def notify_clients(self, kind: str, notice: ScaleNotice) -> None:
        """Sends an elastic notification to every client attached here."""
        self.proc.notify_clients(kind, notice)

    @ray.method(concurrency_group=ENGINE_WATCH_GROUP)
    def wait_for_exit(self, timeout_s: float) -> tuple[bytes, bool]:
        """Blocks until the busy loop ends on purpose (`shutdown`) or `timeout_s` passes.

        The registry keeps this call pending as its liveness watch
        (`shoal.actors.engine_liveness.watch_engine`): if the actor dies, the call fails with a
        RayActorError instead of returning.

        Returns:
            This incarnation's identity, and whether its busy loop has ended.
        """
        self._busy_loop.join(timeout_s)
        return self.endpoint.identity, not self._busy_loop.is_alive()

    @ray.method
    def shutdown(self) -> None:
        """Stops the busy loop and closes the sockets; the actor can then be killed."""
        self._shutdown()

    def _shutdown(self) -> None:
        self.proc.shutdown()
        self._busy_loop.join(timeout=10)


class EngineThread(threading.Thread):
    """The thread that builds a rank's engine and then runs its busy loop.

    One thread does both because of how OpenMP runs on a CPU: the runtime keeps a pool of
    worker threads for every thread that has run a parallel region, and once the pools' threads
    outnumber the CPUs, libgomp stops spinning between regions. An engine built (weights, KV
    cache, warm-up forwards) on the actor's constructor thread and stepped on another leaves
    two pools, and each of a decode step's hundreds of small regions then waits for its
    workers to be woken (on 2 cores, a small parallel add took about 1.4x as long that way).

    States: building → built (or failed: `wait_built` raises the build's error and the thread
    ends) → serving (`serve`) → ended (the loop returned after `shutdown`, or the process
    exits: a loop that fails ends the worker process, so Ray restarts the actor).

    Args:
        build: makes the engine (called on this thread).
        rank: the rank, for the thread's name and logs.
    """

    def __init__(self, build: Callable[[], EngineCoreProc], rank: int) -> None:
        super().__init__(name=f"shoal-busy-loop-{rank}", daemon=True)
        self.rank = rank
        self._build = build
        self._proc: EngineCoreProc | None = None
        self._error: BaseException | None = None
        self._built = threading.Event()
        self._go = threading.Event()
        self.start()

    def wait_built(self) -> EngineCoreProc:
        """Blocks until the engine is built; returns it, or raises what the build raised."""
        self._built.wait()
        if self._proc is None:
            assert self._error is not None
            raise self._error
        return self._proc

    def serve(self) -> None:
        """Starts the busy loop (after `wait_built` returned)."""
        self._go.set()

    def run(self) -> None:
        try:
            self._proc = self._build()
        except BaseException as e:
            self._error = e
            return
        finally:
            self._built.set()
        self._go.wait()
        try:
            self._proc.run_busy_loop()
        except BaseException:
            logger.exception(
                "rank %d: busy loop failed; exiting so Ray restarts the actor", self.rank
            )
            # The proc has told its clients (ENGINE_CORE_DEAD). Ending the worker process is
            # what lets Ray notice, restart this actor, and the registry mark the rank DEAD.
            os._exit(1)


# What callers hold: Ray's typed proxy, so mypy checks every `.remote` call's method,
# arguments and result against EngineCoreActor.
EngineActorHandle: TypeAlias = ActorProxy[EngineCoreActor]


def _ep_rendezvous(
    registry: Any, config: EngineConfig, node_ip: str, group_name: str, rank: int
) -> Rendezvous | None:
    """Where this rank forms its expert-parallel groups (from the registry), if it is EP.

    Raises:
        ValueError: the model cannot be served expert-parallel over this many ranks.
    """
    parallel = config.parallel
    if not parallel.enable_expert_parallel or parallel.data_parallel_size == 1:
        return None
    arch = load_model_arch(local_model_path(config.model))
    check_expert_parallel(arch, parallel.data_parallel_size)
    placement = ExpertPlacement.contiguous(arch.num_local_experts, parallel.data_parallel_size)
    table = list(placement.expert_to_rank)
    host, port = ray.get(registry.ep_rendezvous.remote(node_ip, rank, table))
    return Rendezvous(host, port, group_name=group_name, bind_host=node_ip)


def _load_tokenizer(config: EngineConfig) -> Tokenizer | ModelLoadError:
    """The model's tokenizer, read now for drivers on nodes without the checkpoint
    (`tokenizer()`): this node's copy may not last (a download directory that is cleaned up,
    say). The engine runs on token ids without one."""
    try:
        local = local_model_config(config).model  # a Hub id: downloaded to this node
        return load_tokenizer(local.tokenizer or local.model)
    except ModelLoadError as e:
        return e
