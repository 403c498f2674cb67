"""`RegistryState`: everything the registry keeps, saved to the GCS key-value store on every
change (see `shoal.actors.registry`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.actors.membership import ClientInfo, RankInfo
from shoal.actors.scale_state import ScaleEvent, ScaleRecord
from shoal.engine.config import EngineConfig


@dataclass
class RegistryState:
    config: EngineConfig
    epoch: int = 0
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    clients: dict[int, ClientInfo] = field(default_factory=dict)
    next_client_index: int = 0
    stats_publish_address: str | None = None
    stats_report_address: str | None = None
    stopping: bool = False
    served_by: str | None = None
    ep_placement: list[int] | None = None  # expert -> rank, under expert parallelism
    # CURVE public keys: the coordinator's, and each attached client's by index (kept when a
    # silent client is pruned, since its index is never given to anyone else).
    coordinator_public_key: bytes | None = None
    client_keys: dict[int, bytes] = field(default_factory=dict)
    # Resizes: the one holding the scale lock, the last epoch handed out, the rendezvous
    # prefix of the current set's groups (None: the namespace), and the past scales.
    scale: ScaleRecord | None = None
    scale_epoch: int = 0
    ep_group_name: str | None = None
    scale_history: list[ScaleEvent] = field(default_factory=list)
    # How the launch started its ranks (reservation, placement, bind address), for resizes.
    launch_options: dict[str, Any] = field(default_factory=dict)
