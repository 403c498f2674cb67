"""`GrammarSandbox` with its real child processes: a constraint that compiles passes, one that
does not or that crashes the compiler is a 400 for itself alone, and the sandbox goes on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from http import HTTPStatus

import pytest
import pytest_asyncio

from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.grammar_sandbox import GrammarSandbox
from shoal.engine.protocol import StructuredOutputsParams
from tests.security.poison_inputs import (
    CRASHING_LARK_LENGTH,
    CRASHING_SCHEMA_LENGTH,
    lark_chain,
    ref_chain_schema,
)

TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}


@pytest_asyncio.fixture
async def sandbox() -> AsyncIterator[GrammarSandbox]:
    made = GrammarSandbox()
    yield made
    await made.aclose()


async def _refusal(sandbox: GrammarSandbox, params: StructuredOutputsParams) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        await sandbox.check(params)
    return caught.value


async def test_a_schema_that_compiles_passes_and_is_remembered(sandbox: GrammarSandbox) -> None:
    await sandbox.check(StructuredOutputsParams(json=TOOL_SCHEMA))
    await sandbox.check(StructuredOutputsParams(json=TOOL_SCHEMA))
    await sandbox.check(None)
    assert sandbox.num_checks == 1  # the second answered from memory


async def test_a_constraint_that_does_not_compile_is_a_400(sandbox: GrammarSandbox) -> None:
    error = await _refusal(sandbox, StructuredOutputsParams(grammar="start: undefined_rule"))
    assert error.status == HTTPStatus.BAD_REQUEST
    assert "does not compile" in error.message
    assert sandbox.num_crashes == 0


@pytest.mark.parametrize(
    "poison",
    [
        StructuredOutputsParams(json=ref_chain_schema(CRASHING_SCHEMA_LENGTH)),
        StructuredOutputsParams(grammar=lark_chain(CRASHING_LARK_LENGTH)),
    ],
    ids=["ref-chain", "lark-chain"],
)
async def test_a_constraint_that_crashes_the_compiler_costs_only_its_request(
    sandbox: GrammarSandbox, poison: StructuredOutputsParams
) -> None:
    error = await _refusal(sandbox, poison)
    assert error.status == HTTPStatus.BAD_REQUEST
    assert "crashed the grammar compiler" in error.message
    assert sandbox.num_crashes == 1
    # A fresh child serves the next request...
    await sandbox.check(StructuredOutputsParams(json=TOOL_SCHEMA))
    assert sandbox.num_checks == 2
    # ...and the same poison again is refused from memory, without one.
    again = await _refusal(sandbox, poison)
    assert again.message == error.message
    assert (sandbox.num_checks, sandbox.num_crashes, sandbox.num_poisoned) == (2, 1, 2)


async def test_a_compile_past_the_timeout_is_refused(sandbox: GrammarSandbox) -> None:
    await sandbox.check(StructuredOutputsParams(json=TOOL_SCHEMA))  # the child is up
    sandbox.timeout_s = 0.001  # a long chain takes tens of milliseconds to compile
    error = await _refusal(sandbox, StructuredOutputsParams(grammar=lark_chain(2_000)))
    assert "took longer than" in error.message
    sandbox.timeout_s = 30.0
    await sandbox.check(StructuredOutputsParams(regex="[a-z]+"))


async def test_checks_past_the_bound_are_refused_with_503() -> None:
    sandbox = GrammarSandbox(max_pending=1)
    try:
        first = asyncio.ensure_future(sandbox.check(StructuredOutputsParams(regex="[0-9]+")))
        await asyncio.sleep(0)  # the first check starts its child
        error = await _refusal(sandbox, StructuredOutputsParams(regex="[a-z]+"))
        assert error.status == HTTPStatus.SERVICE_UNAVAILABLE
        await first
    finally:
        await sandbox.aclose()


async def test_a_check_cancelled_midway_leaves_no_answer_for_the_next(
    sandbox: GrammarSandbox,
) -> None:
    """A client that hangs up cancels its check; the next check must get its own verdict,
    not the cancelled one's late answer."""
    await sandbox.check(StructuredOutputsParams(json=TOOL_SCHEMA))  # the child is up
    slow = asyncio.ensure_future(sandbox.check(StructuredOutputsParams(grammar=lark_chain(2_000))))
    while sandbox.num_checks < 2:  # it reached the child
        await asyncio.sleep(0.001)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    error = await _refusal(sandbox, StructuredOutputsParams(grammar="start: undefined_rule"))
    assert "does not compile" in error.message
    await sandbox.check(StructuredOutputsParams(regex="[a-z]+"))
