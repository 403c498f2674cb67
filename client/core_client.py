"""The seed's engine-core client family, in one import: `MPClient`, `SyncMPClient`, `AsyncMPClient`.

The implementations live in `shoal.client.mp_client` (the engine set and the blocking HELLO
driver; the handshake itself is `shoal.client.attach`), `shoal.client.sync_mp_client` and
`shoal.client.async_mp_client`; this module only gathers them.
"""

from __future__ import annotations

from shoal.client.async_mp_client import AsyncMPClient
from shoal.client.mp_client import BackgroundResources, EngineAttachError, MPClient
from shoal.client.output_dispatch import EngineUtilityError
from shoal.client.sync_mp_client import SyncMPClient

__all__ = [
    "AsyncMPClient",
    "BackgroundResources",
    "EngineAttachError",
    "EngineUtilityError",
    "MPClient",
    "SyncMPClient",
]
