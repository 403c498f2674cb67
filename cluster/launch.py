"""The whole actor topology of a shoal cluster on one screen: launch, attach, shut down.

    namespace "<ns>"
    ├── RegistryActor      "shoal-registry"      config, membership + epochs, clients, liveness
    ├── CoordinatorActor   "shoal-coordinator"   engines PUSH stats → XPUB to clients
    ├── ClusterOwnerActor  "shoal-owner"         creates (so owns) every rank's group and actor
    ├── AutoscalerActor    "shoal-autoscaler"    with --autoscale (`shoal.cluster.autoscaler`)
    └── EngineCoreActor    "shoal-engine-<r>"    one per rank, in placement group
                                                 "shoal-<ns>-rank-<r>"

Readiness handshake: the registry, coordinator and owner start first; the coordinator's
addresses and the launch's options (what a rank reserves, how ranks are placed, the bind
address) go into the registry, so a later resize starts ranks alike; each rank's placement
group is reserved (by the owner, as its actor is created); each engine actor reads the
addresses from the registry, binds its ZMQ input, starts its busy loop and registers its
endpoint itself (the registry then watches it); `launch` returns once every rank's `ready()`
has answered. A rank restarted by Ray repeats the same steps under a new identity.

The steps live beside: `shoal.cluster.ranks` starts ranks (`add_ranks`, `LaunchOptions`),
`shoal.cluster.handle` holds a running cluster (`ClusterHandle`) and stops ranks.
"""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shoal.actors.coordinator import CoordinatorActor, CoordinatorHandle
from shoal.actors.names import COORDINATOR_NAME, OWNER_NAME, REGISTRY_NAME
from shoal.actors.owner import ClusterOwnerActor, OwnerHandle
from shoal.actors.registry import RegistryActor, RegistryHandle
from shoal.cluster.handle import ClusterHandle, get_named_actor, registry_answers_again
from shoal.cluster.ranks import (
    CONTROL_START_TIMEOUT_S,
    READY_TIMEOUT_S,
    EngineStartError,
    LaunchOptions,
    LaunchStopped,
    add_ranks,
    check_rank_resources,
    default_resources,
)
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair
from shoal.engine.core.vllm_args import require_vllm
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import load_model_arch
from shoal.engine.loader.hub import local_model_path
from shoal.engine.parallel.expert_parallel import check_expert_parallel
from shoal.engine.parallel.tensor_parallel import check_tensor_parallel

logger = logging.getLogger(__name__)

# The cluster layer's entry points, in one import.
__all__ = [
    "DEFAULT_NAMESPACE",
    "READY_TIMEOUT_S",
    "ClusterExistsError",
    "ClusterHandle",
    "ClusterNotFoundError",
    "EngineStartError",
    "LaunchOptions",
    "LaunchStopped",
    "attach",
    "check_launchable",
    "is_stopped",
    "launch",
    "registry_answers_again",
]

DEFAULT_NAMESPACE = "shoal"


class ClusterExistsError(RuntimeError):
    """A shoal cluster already runs in this namespace."""


class ClusterNotFoundError(RuntimeError):
    """No shoal cluster runs in this namespace."""


def launch(
    config: EngineConfig,
    options: LaunchOptions | None = None,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    served_by: str | None = None,
) -> ClusterHandle:
    """Starts a named cluster of `config.parallel.data_parallel_size` engine ranks.

    Args:
        config: the engine configuration shared by all ranks.
        options: how the ranks are started (what each reserves, how they are placed, the bind
            address, detached or not, how long start-up may take); default
            `LaunchOptions(default_resources(tensor_parallel_size))`: one GPU per worker of a
            rank when the cluster has GPUs, else one CPU per worker.
        namespace: Ray namespace the cluster's named actors live in.
        served_by: the process that serves the cluster ("host:pid"), recorded in the registry
            before any rank starts, so that `shoal stop` asks it to stop, launch included.

    Returns:
        A handle on the running cluster; every rank is READY in the registry.

    Raises:
        ValueError: `--enable-expert-parallel` on a dense model or over more ranks than it
            has experts, a TP size the model cannot be split by, GPUs per rank that are not
            one per TP worker (checked before anything starts).
        ClusterExistsError: if the namespace already has a cluster.
        EngineStartError: if an engine fails to start (nothing is left behind).
        ray.exceptions.GetTimeoutError: if placement or start-up exceed
            `options.ready_timeout_s`.
        LaunchStopped: `shoal stop` asked the cluster to stop while its ranks started
            (nothing is left behind).
    """
    check_launchable(config)
    _require_ray(namespace)
    if get_named_actor(REGISTRY_NAME, namespace) is not None:
        raise ClusterExistsError(f"a shoal cluster already runs in namespace {namespace!r}")
    options = options or LaunchOptions(default_resources(config.parallel.tensor_parallel_size))
    check_rank_resources(config, options.resources)
    lifetime = "detached" if options.detached else None
    # All three are restarted by Ray when they die, their node included: the registry reads
    # its saved state back, the coordinator binds its old addresses again (see their modules)
    # and the owner holds nothing a detached cluster needs. They start on the launching node
    # (Ray would put actors that reserve nothing on any node at random), softly, so that a
    # restart after that node is lost goes wherever Ray finds room.
    control = {
        "namespace": namespace,
        "lifetime": lifetime,
        "num_cpus": 0,
        "max_restarts": -1,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=True
        ),
    }
    registry: RegistryHandle = (
        ray.remote(RegistryActor)
        .options(name=REGISTRY_NAME, **control)
        .remote(namespace, config, options.detached)
    )
    # The coordinator's key pair is made here and lives in its constructor's arguments, so a
    # coordinator that Ray restarts is the same CURVE server to every engine and client.
    coordinator_keys = CurveKeyPair.generate()
    coordinator: CoordinatorHandle = (
        ray.remote(CoordinatorActor)
        .options(name=COORDINATOR_NAME, **control)
        .remote(options.host or "", namespace, coordinator_keys)
    )
    owner: OwnerHandle = ray.remote(ClusterOwnerActor).options(name=OWNER_NAME, **control).remote()
    handle = ClusterHandle(namespace, registry, coordinator, owner=owner)
    try:
        # The control actors' start is not the ranks' placement: it has its own bound.
        report_address, publish_address = ray.get(
            coordinator.addresses.remote(), timeout=CONTROL_START_TIMEOUT_S
        )
        ray.get(
            registry.set_coordinator.remote(
                report_address, publish_address, coordinator_keys.public
            )
        )
        ray.get(registry.set_launch_options.remote(options.as_dict()))
        if served_by is not None:
            ray.get(registry.set_served_by.remote(served_by))
        add_ranks(handle, config, range(config.parallel.data_parallel_size), options)
    except BaseException as e:  # the caller gets `e`, with its traceback
        logger.error("launch of namespace %r failed (%s); tearing down", namespace, e)
        handle.shutdown()
        raise
    return handle


def check_launchable(config: EngineConfig) -> None:
    """Refuses, before anything starts, a configuration no rank could serve.

    Raises:
        ValueError: expert parallelism on a dense model, or over more ranks than experts; a
            tensor-parallel size the model cannot be split by; vLLM's engine where vLLM is
            not installed (its ranks check the model and the split themselves).
    """
    if config.rank_engine.engine == "vllm":
        require_vllm()
        return
    parallel = config.parallel
    if not parallel.enable_expert_parallel and parallel.tensor_parallel_size == 1:
        return
    try:
        arch = load_model_arch(local_model_path(config.model))
    except ModelLoadError:
        return  # not readable here (another node's path): the ranks check it as they start
    check_tensor_parallel(arch, parallel.tensor_parallel_size)
    if parallel.enable_expert_parallel:
        check_expert_parallel(arch, parallel.data_parallel_size)


def attach(namespace: str = DEFAULT_NAMESPACE) -> ClusterHandle:
    """Finds a running cluster by namespace (connecting to Ray at "auto" if needed).

    Raises:
        ClusterNotFoundError: if there is none.
    """
    _require_ray(namespace)
    registry = get_named_actor(REGISTRY_NAME, namespace)
    coordinator = get_named_actor(COORDINATOR_NAME, namespace)
    if registry is None or coordinator is None:
        raise ClusterNotFoundError(f"no shoal cluster runs in namespace {namespace!r}")
    owner = get_named_actor(OWNER_NAME, namespace)
    return ClusterHandle(namespace, registry, coordinator, owner=owner)


def is_stopped(namespace: str) -> bool:
    """Whether the cluster in `namespace` is gone for good: its registry's name is free.

    A registry that Ray is restarting keeps its name; one stopped with its cluster does not.
    """
    return get_named_actor(REGISTRY_NAME, namespace) is None


def _require_ray(namespace: str) -> None:
    if not ray.is_initialized():
        ray.init(address="auto", namespace=namespace, log_to_driver=False)
