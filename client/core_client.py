"""The seed's engine-core client family, in one import: `MPClient`, `SyncMPClient`, `AsyncMPClient`.

The implementations live in `client.mp_client` (sockets, handshake, engine set),
`client.sync_mp_client` and `client.async_mp_client`; this module only gathers them.
"""

from __future__ import annotations

from client.async_mp_client import AsyncMPClient
from client.mp_client import BackgroundResources, EngineAttachError, EngineUtilityError, MPClient
from client.sync_mp_client import SyncMPClient

__all__ = [
    "AsyncMPClient",
    "BackgroundResources",
    "EngineAttachError",
    "EngineUtilityError",
    "MPClient",
    "SyncMPClient",
]
