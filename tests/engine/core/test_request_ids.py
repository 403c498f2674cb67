"""The one request-id scoping: a client's id in, the engine's id inside, the client's id out."""

from __future__ import annotations

from shoal.engine.core.request_ids import scoped, scoped_all, unscope_outputs, unscoped
from shoal.engine.protocol import EngineCoreOutput


def test_two_clients_same_id_are_two_engine_ids_and_each_gets_its_own_back() -> None:
    mine, theirs = scoped(3, "req/1"), scoped(12, "req/1")
    assert mine != theirs and scoped_all(3, ["req/1"]) == [mine]
    assert unscoped(3, mine) == unscoped(12, theirs) == "req/1"
    outputs = [EngineCoreOutput(theirs), EngineCoreOutput("")]
    unscope_outputs(12, outputs)
    assert [o.request_id for o in outputs] == ["req/1", ""]


def test_an_empty_id_stays_empty_to_be_refused() -> None:
    assert scoped(0, "") == ""
