"""The output classifier alone: real wire frames in, one typed decision out, no client."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from shoal.client.transport.attach import RECHECK_NOTICE, DeathNotice, RecheckNotice, death_notice
from shoal.client.transport.output_classifier import Dropped, OutputClassifier, ScaleNotification
from shoal.engine.parallel.elastic import RECONFIGURED, ScaleNotice
from shoal.engine.protocol import (
    EEP_NOTIFICATION_CALL_ID,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import MsgpackEncoder, tag_structs
from tests.engine.core_proc_utils import MALFORMED_OUTPUT_MESSAGES


def _frames(parts: list[bytes | memoryview]) -> list[zmq.Frame]:
    return [zmq.Frame(bytes(part)) for part in parts]


def _wire(outputs: EngineCoreOutputs) -> list[zmq.Frame]:
    return _frames(MsgpackEncoder().encode(outputs))


def test_an_engines_outputs_are_the_decision_itself() -> None:
    sent = EngineCoreOutputs(
        engine_index=1,
        outputs=[EngineCoreOutput("r", new_token_ids=[5, 6])],
        scheduler_stats=SchedulerStats(num_running_reqs=1),
    )
    decision = OutputClassifier().classify(_wire(sent))
    assert isinstance(decision, EngineCoreOutputs)
    assert decision.outputs[0].new_token_ids == [5, 6] and decision.engine_index == 1


def test_a_reply_is_its_utility_output() -> None:
    reply = UtilityOutput(77, result=UtilityResult(tag_structs(SchedulerStats())))
    decision = OutputClassifier().classify(_wire(EngineCoreOutputs(utility_output=reply)))
    assert isinstance(decision, UtilityOutput) and decision.call_id == 77
    refused = UtilityOutput(78, failure_message="no such method")
    decision = OutputClassifier().classify(_wire(EngineCoreOutputs(utility_output=refused)))
    assert isinstance(decision, UtilityOutput) and decision.failure_message == "no such method"


def test_an_elastic_notification_is_told_apart_from_replies() -> None:
    notice = msgspec.to_builtins(ScaleNotice(3, 1, request_ids=["a"]))
    output = UtilityOutput(EEP_NOTIFICATION_CALL_ID, result=UtilityResult([RECONFIGURED, notice]))
    decision = OutputClassifier().classify(_wire(EngineCoreOutputs(utility_output=output)))
    assert decision == ScaleNotification([RECONFIGURED, notice])


@pytest.mark.parametrize("result", [None, "ab", [RECONFIGURED], 7])
def test_a_notification_that_is_not_kind_and_payload_is_dropped(result: object) -> None:
    classifier = OutputClassifier()
    utility = UtilityResult(result) if result is not None else None
    output = UtilityOutput(EEP_NOTIFICATION_CALL_ID, result=utility)
    decision = classifier.classify(_wire(EngineCoreOutputs(utility_output=output)))
    assert isinstance(decision, Dropped) and classifier.num_dropped == 1


def test_the_monitors_notices() -> None:
    classifier = OutputClassifier()
    assert classifier.classify(_frames(death_notice(4))) == DeathNotice(4)
    assert classifier.classify(_frames([*RECHECK_NOTICE])) == RecheckNotice()
    assert classifier.num_dropped == 0


def test_every_malformed_message_is_dropped_and_counted() -> None:
    classifier = OutputClassifier()
    decisions = [classifier.classify(_frames(m)) for m in MALFORMED_OUTPUT_MESSAGES]
    # A death notice naming an engine the client may not have is still a notice: the
    # engine set, not the classifier, knows which engines there are.
    assert decisions.count(DeathNotice(7)) == 1
    dropped = [d for d in decisions if isinstance(d, Dropped)]
    assert len(dropped) == len(MALFORMED_OUTPUT_MESSAGES) - 1 == classifier.num_dropped
    assert any("names no engine" in d.reason for d in dropped)
