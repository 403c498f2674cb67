"""The HELLO handshake's state machine (`shoal.client.transport.attach`) on real frames, and its drivers.

The machine is driven with frames made by the real codec: its HELLOs are decoded as an engine
decodes them, and the answers are `EngineCoreOutputs` encoded as an engine encodes them and
classified by the client's own `OutputClassifier`. The last tests drive the one recheck policy
through both clients against a real engine.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from shoal.client import AsyncMPClient, SyncMPClient
from shoal.client.transport.attach import (
    HELLO_RESEND_S,
    KEY_REFUSAL_POLL_S,
    RECHECK_NOTICE,
    Attached,
    DeathNotice,
    Handshake,
    HelloMaker,
    LetGo,
    MalformedNotice,
    Purpose,
    RecheckNotice,
    Refused,
    Step,
    StillAttached,
    TimedOut,
    death_notice,
    read_notice,
)
from shoal.client.transport.engine_set import EngineSet
from shoal.client.transport.output_classifier import OutputClassifier
from shoal.client.transport.output_dispatch import learn_death
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequestType,
    EngineEndpoint,
    EngineFacts,
    EngineHello,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder, tag_structs
from tests.engine.core_proc_utils import RawPeer, ServedEngine, request

ENDPOINT = EngineEndpoint(2, b"engine-2", "tcp://127.0.0.1:5002")
FACTS = EngineFacts(2, b"engine-2", "tiny", 128, 10, 16, 512, attach_serial=3)
OUTPUT_ADDRESS = "tcp://127.0.0.1:6000"
T0 = 100.0
LET_GO_LOG = "engine 0 no longer counts this client attached (it attached this client afresh)"  # the drivers' clock is theirs; the machine only compares its readings


def _maker(*, wants_kv_events: bool = False) -> HelloMaker:
    return HelloMaker(7, OUTPUT_ADDRESS, wants_kv_events=wants_kv_events)


def _started(purpose: Purpose = Purpose.ATTACH, known: EngineFacts | None = None) -> Handshake:
    handshake = _maker().handshake(ENDPOINT, purpose, timeout_s=10.0, known=known)
    handshake.start(T0)
    return handshake


def _engine_frames(call_id: int, *, result: object = FACTS, failure: str | None = None) -> list:
    """An engine's answer as it goes on the wire: an encoded `EngineCoreOutputs`."""
    if failure is not None:
        utility = UtilityOutput(call_id, failure_message=failure)
    else:
        value = tag_structs(result) if isinstance(result, msgspec.Struct) else result
        utility = UtilityOutput(call_id, result=UtilityResult(value))
    encoded = MsgpackEncoder().encode(EngineCoreOutputs(engine_index=2, utility_output=utility))
    return [zmq.Frame(bytes(frame)) for frame in encoded]


def _reply(handshake: Handshake, **kwargs: object) -> Step:
    """Feeds the engine's answer, decoded by the client's decoder, to the handshake."""
    reply = OutputClassifier().classify(_engine_frames(handshake.call_id, **kwargs))
    assert isinstance(reply, UtilityOutput)
    return handshake.on_reply(reply)


def test_start_sends_the_hello_an_engine_decodes() -> None:
    handshake = _maker(wants_kv_events=True).handshake(ENDPOINT, Purpose.ATTACH, timeout_s=5.0)
    step = handshake.start(T0)
    assert step.outcome is None and step.send is not None and not step.is_resend
    request_type, *payload = step.send
    assert request_type == EngineCoreRequestType.HELLO.value
    hello = MsgpackDecoder(EngineHello).decode(payload)
    assert (hello.client_index, hello.output_address, hello.call_id) == (
        7,
        OUTPUT_ADDRESS,
        handshake.call_id,
    )
    assert hello.wants_kv_events
    assert handshake.deadline == T0 + 5.0
    with pytest.raises(AssertionError, match="starts once"):
        handshake.start(T0)


def test_every_handshake_has_its_own_call_id() -> None:
    maker = _maker()
    ids = {maker.handshake(ENDPOINT, Purpose.ATTACH, timeout_s=1.0).call_id for _ in range(50)}
    assert len(ids) == 50


def test_waiting_resends_the_same_hello_then_times_out() -> None:
    handshake = _maker().handshake(ENDPOINT, Purpose.ATTACH, timeout_s=5.0)
    first = handshake.start(T0).send
    assert handshake.wait_s(T0) == pytest.approx(KEY_REFUSAL_POLL_S)
    assert handshake.on_tick(T0 + 1.0) == Step()  # nothing due yet
    again = handshake.on_tick(T0 + HELLO_RESEND_S)
    assert again.is_resend and again.send == first and again.outcome is None
    assert handshake.on_tick(T0 + HELLO_RESEND_S + 0.5) == Step()  # the next resend is later
    assert handshake.on_tick(T0 + 2 * HELLO_RESEND_S).is_resend
    assert handshake.wait_s(T0 + 4.95) == pytest.approx(0.05)  # never past the deadline
    done = handshake.on_tick(T0 + 5.0)
    assert done.send is None and done.outcome == TimedOut("engine 2 did not answer HELLO in time")
    assert handshake.is_done


def test_an_answer_with_the_facts_attaches() -> None:
    handshake = _started()
    step = _reply(handshake)
    assert step == Step(outcome=Attached(FACTS)) and handshake.outcome == Attached(FACTS)


@pytest.mark.parametrize("purpose", [Purpose.ATTACH, Purpose.REATTACH])
def test_an_engine_that_refuses_refuses_with_its_reason(purpose: Purpose) -> None:
    step = _reply(_started(purpose), failure="client_index 7 is already attached")
    assert step.outcome == Refused(
        "engine 2 refused this client: client_index 7 is already attached"
    )


def test_a_refused_key_refuses_at_once() -> None:
    outcome = _started().on_key_refused().outcome
    assert isinstance(outcome, Refused) and "not admitted" in outcome.reason


def test_an_answer_without_facts_is_a_refusal() -> None:
    outcome = _reply(_started(), result=None).outcome
    assert outcome == Refused("engine 2 sent no facts at HELLO")
    outcome = _reply(_started(), result=[1, 2]).outcome
    assert outcome == Refused("engine 2 sent no facts at HELLO")


def test_facts_of_another_engine_are_a_refusal() -> None:
    stranger = msgspec.structs.replace(FACTS, identity=b"engine-2-restarted")
    outcome = _reply(_started(), result=stranger).outcome
    assert isinstance(outcome, Refused) and "as another engine" in outcome.reason


def test_a_recheck_under_the_same_serial_is_still_attached() -> None:
    outcome = _reply(_started(Purpose.RECHECK, known=FACTS)).outcome
    assert outcome == StillAttached(FACTS)


def test_a_recheck_under_a_new_serial_was_let_go() -> None:
    afresh = msgspec.structs.replace(FACTS, attach_serial=4)
    outcome = _reply(_started(Purpose.RECHECK, known=FACTS), result=afresh).outcome
    assert outcome == LetGo(afresh, "it attached this client afresh")


def test_a_refused_recheck_was_let_go() -> None:
    outcome = _reply(_started(Purpose.RECHECK, known=FACTS), failure="the engine is full").outcome
    assert isinstance(outcome, LetGo) and outcome.facts is None
    assert "the engine is full" in outcome.evidence


def test_a_recheck_knows_its_facts_and_an_attach_does_not() -> None:
    with pytest.raises(AssertionError, match="knows its facts"):
        _maker().handshake(ENDPOINT, Purpose.RECHECK, timeout_s=1.0)
    with pytest.raises(AssertionError, match="knows its facts"):
        _maker().handshake(ENDPOINT, Purpose.ATTACH, timeout_s=1.0, known=FACTS)


def test_a_finished_handshake_ignores_every_later_event() -> None:
    handshake = _started()
    outcome = _reply(handshake).outcome
    assert handshake.on_tick(T0 + 60.0) == Step()
    assert handshake.on_key_refused() == Step()
    assert handshake.on_refusal("late") == Step()
    assert handshake.on_answer(FACTS) == Step()
    assert handshake.outcome == outcome


def test_an_answer_to_another_hello_is_not_this_ones() -> None:
    handshake = _started()
    with pytest.raises(AssertionError, match="another HELLO"):
        handshake.on_reply(UtilityOutput(handshake.call_id + 1))


def test_notices_are_told_from_engine_messages() -> None:
    def frames(parts: list[bytes]) -> list[zmq.Frame]:
        return [zmq.Frame(p) for p in parts]

    assert read_notice(frames(death_notice(3))) == DeathNotice(3)
    assert read_notice(frames(RECHECK_NOTICE)) == RecheckNotice()
    assert read_notice(frames([b"ENGINE_CORE_DEAD", b"x1"])) == MalformedNotice(b"x1")
    assert read_notice(_engine_frames(1)) is None  # an engine's message
    assert read_notice(frames([b"SIXTEEN_BYTES_OK", b"1"])) is None
    assert read_notice(frames([b"ENGINE_CORE_DEAD"])) is None


def test_a_death_is_told_once_and_only_for_an_engine_of_the_set() -> None:
    engines = EngineSet()
    engines.attach(ENDPOINT)
    engines.mark_attached(2, FACTS)
    dead = learn_death(2, engines)
    assert isinstance(dead, EngineDeadError) and dead.engine_index == 2
    assert engines.dead() == [2]
    assert learn_death(2, engines) is None  # told already
    assert learn_death(9, engines) is None  # not an engine of this client


# --- the one recheck policy, through both clients ------------------------------------------


def _serial(client: SyncMPClient | AsyncMPClient) -> int:
    facts = client.engine_set.facts(0)
    assert facts is not None, "attached"
    return facts.attach_serial


def _let_go_by_an_impostor(engine: ServedEngine, output_address: str) -> RawPeer:
    """Makes the engine let client 0 go without a word: a new connection says HELLO with its
    index and output address, so the engine takes it for the client come back."""
    impostor = RawPeer(engine.endpoint)
    impostor.send_typed(EngineCoreRequestType.HELLO, EngineHello(0, output_address, call_id=1))
    return impostor


def test_the_blocking_client_counts_a_let_go_engine_lost_then_attaches_it_again(
    engine: ServedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    client = SyncMPClient([engine.endpoint])
    client.set_engines_can_return(True)  # as a cluster link's client: the loss is not final
    impostor = None
    try:
        serial = _serial(client)
        client.add_request(request("lost", max_tokens=200, ignore_eos=True))
        client.get_output(timeout=10)
        impostor = _let_go_by_an_impostor(engine, client.output_address)
        with pytest.raises(EngineDeadError) as info:  # the recheck finds it let go
            while True:
                client.get_output(timeout=10)
        assert info.value.engine_index == 0 and client.engine_set.dead() == [0]
        assert LET_GO_LOG in caplog.text  # found by the recheck, not by a dropped connection
        client.add_request(request("after", max_tokens=3))  # attached again first
        assert _serial(client) > serial
        finished: list[str] = []
        while "after" not in finished:
            finished += [o.request_id for o in client.get_output(timeout=10).outputs if o.finished]
    finally:
        client.shutdown()
        if impostor is not None:
            impostor.close()


async def test_the_asyncio_client_counts_a_let_go_engine_lost_the_same_way(
    engine: ServedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    client = AsyncMPClient([engine.endpoint])
    client.set_engines_can_return(True)
    impostor = None
    try:
        serial = _serial(client)
        await client.add_request_async(request("lost", max_tokens=200, ignore_eos=True))
        await asyncio.wait_for(client.get_output_async(), 10)
        impostor = _let_go_by_an_impostor(engine, client.output_address)
        with pytest.raises(EngineDeadError) as info:
            while True:
                await asyncio.wait_for(client.get_output_async(), 10)
        assert info.value.engine_index == 0 and client.engine_set.dead() == [0]
        assert LET_GO_LOG in caplog.text  # found by the recheck, not by a dropped connection
        facts = await asyncio.wait_for(client.reattach_engine_async(0), 10)
        assert facts.attach_serial > serial and client.engine_set.routable() == [0]
    finally:
        client.shutdown()
        if impostor is not None:
            impostor.close()
