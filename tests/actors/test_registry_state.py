"""`RegistryState` as it is saved and read back: every part's state survives the round trip."""

from __future__ import annotations

import msgspec

from shoal.actors.membership import ClientInfo, RankInfo, RankState
from shoal.actors.registry_state import RegistryState
from shoal.actors.scale_state import ScaleEvent, ScaleRecord
from shoal.engine.config import EngineConfig
from shoal.engine.parallel.elastic import ScalePlan
from shoal.engine.protocol import EngineEndpoint


def test_the_saved_state_reads_back_whole() -> None:
    config = EngineConfig.from_kwargs("/models/none", data_parallel_size=2)
    state = RegistryState.new(config)
    endpoint = EngineEndpoint(0, b"0:a", "tcp://127.0.0.1:5000", public_key=b"k" * 40)
    state.membership.ranks[0] = RankInfo(0, RankState.READY, "e-0", "pg-0", 1, endpoint)
    state.membership.clients[3] = ClientInfo(3, "driver", 1.0, 2.0)
    state.membership.epoch = 9
    plan = ScalePlan(4, 3, "ns/resize-4", expert_to_rank=(0, 1, 2, 2))
    state.resizes.scale = ScaleRecord(4, "me", 2, 3, "switching", 1.0, 2.0, plan, [2])
    state.resizes.scale_history = [ScaleEvent(3, 1, 2, "committed", 1.5)]
    state.resizes.launch_options = {"num_cpus": 1.0, "num_gpus": 0.0, "host": None}

    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=RegistryState)

    assert restored == state
    assert restored.resizes.scale is not None and restored.resizes.scale.plan == plan
