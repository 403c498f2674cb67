"""`EngineSet`: the one record of a client's engines — its states, and what routing sees of it."""

from __future__ import annotations

import asyncio

import pytest

from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.client.routing.migration import RequestsLostError
from shoal.client.transport.engine_set import EngineSet
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import EngineCoreRequest, EngineEndpoint, EngineFacts
from tests.client.async_utils import collect
from tests.engine.core_proc_utils import ServedEngine, request, tiny_config


def _pinned(request_id: str, rank: int) -> EngineCoreRequest:
    pinned = request(request_id, max_tokens=3, ignore_eos=True)
    pinned.data_parallel_rank = rank
    return pinned


def _endpoint(index: int) -> EngineEndpoint:
    return EngineEndpoint(index, f"engine-{index}".encode(), f"tcp://127.0.0.1:{5000 + index}")


def _facts(index: int, serial: int = 1) -> EngineFacts:
    return EngineFacts(
        engine_index=index,
        identity=f"engine-{index}".encode(),
        model="tiny",
        max_model_len=64,
        num_kv_blocks=8,
        block_size=16,
        vocab_size=128,
        attach_serial=serial,
    )


def test_an_engine_is_routable_only_once_attached_and_while_alive() -> None:
    engines = EngineSet()
    engines.attach(_endpoint(0))
    engines.attach(_endpoint(1))
    assert engines.indices() == [0, 1] and engines.routable() == []
    engines.mark_attached(0, _facts(0))
    engines.mark_attached(1, _facts(1))
    assert engines.routable() == [0, 1]
    with pytest.raises(ValueError, match="already attached"):
        engines.attach(_endpoint(1))
    assert engines.learn_death(1)  # news: told once
    assert not engines.learn_death(1)
    assert engines.routable() == [0] and engines.dead() == [1]
    assert engines.is_terminal(EngineDeadError(engine_index=1)) is False  # 0 still serves
    engines.remove(1)
    assert 1 not in engines and engines.index_of(b"engine-1") is None
    assert not engines.learn_death(1)  # a removed engine's goodbye is no news


def test_a_dead_engine_that_may_return_is_attached_again_and_a_lost_one_is_terminal() -> None:
    engines = EngineSet(engines_can_return=True)
    engines.attach(_endpoint(0))
    engines.mark_attached(0, _facts(0))
    assert engines.learn_death(0)
    assert not engines.is_terminal(EngineDeadError(engine_index=0))  # it may come back
    engines.begin_reattach(0)
    assert engines.facts(0) is None and engines.routable() == []
    engines.mark_attached(0, _facts(0, serial=2))
    assert engines.routable() == [0] and engines.attached_facts()[0][1].attach_serial == 2
    engines.returns.engines_can_return = False  # the cluster stopped: nobody brings it back
    assert engines.learn_death(0)
    assert engines.is_terminal(EngineDeadError(engine_index=0))


def test_a_set_emptied_by_removal_ends_the_client_only_if_no_engine_may_come() -> None:
    # A cluster client whose every rank refused its first HELLO (its key not yet admitted)
    # has removed them all; its cluster link attaches them again: not the end.
    engines = EngineSet(engines_can_return=True)
    engines.attach(_endpoint(0))
    engines.remove(0)
    removed = EngineDeadError("it was removed from this client", engine_index=0)
    assert not engines.is_terminal(removed)
    engines.returns.engines_can_return = False
    assert engines.is_terminal(removed)


async def test_removing_reattaching_and_losing_a_rank_changes_the_one_engine_set(
    engine_checkpoint: str,
) -> None:
    zero = ServedEngine(tiny_config(engine_checkpoint), engine_index=0)
    one = ServedEngine(tiny_config(engine_checkpoint), engine_index=1)
    client = DPLBAsyncMPClient([zero.endpoint, one.endpoint])
    try:
        engines = client.engine_set
        assert engines.routable() == client.lb_engines == [0, 1]
        client.remove_engine(1)
        assert engines.indices() == [0] and client.lb_engines == [0]
        assert 1 not in client.kv_index.views  # its cache leaves the routing index too
        with pytest.raises(EngineDeadError, match="removed") as removed:
            await client.get_output_async()  # what was on it will get no more outputs
        assert removed.value.engine_index == 1
        with pytest.raises(RequestError, match="not serving"):
            client.get_core_engine_for_request(_pinned("to-one", 1))

        await asyncio.sleep(0.3)  # the identity's reconnect guard (libzmq#1572)
        await client.add_engine_async(one.endpoint)
        assert engines.routable() == client.lb_engines == [0, 1]
        assert 1 in client.kv_index.views  # back, with a view of its own to sync
        await client.add_request_async(_pinned("on-one", 1))
        assert client.rank_of("on-one") == 1

        one.stop()  # lost: routing stops at once; its request, pinned, cannot move
        # First the requests it could not move, each with its own error, then the death.
        with pytest.raises(RequestsLostError) as lost:
            await collect(client, {"on-one"})
        assert type(lost.value) is RequestsLostError  # not suspected: nothing to compile
        assert lost.value.request_ids == ["on-one"] and lost.value.engine_index == 1
        with pytest.raises(EngineDeadError) as info:
            await client.get_output_async()
        assert type(info.value) is EngineDeadError and info.value.engine_index == 1
        assert engines.dead() == [1] and engines.indices() == [0, 1]
        assert client.lb_engines == [0] and client.rank_of("on-one") is None
        assert 1 not in client.router.loads
        await client.add_request_async(request("after", max_tokens=2))
        assert client.rank_of("after") == 0
        assert (await collect(client, {"after"}))["after"][-1].finished
    finally:
        client.shutdown()
        zero.stop()
        one.stop()
