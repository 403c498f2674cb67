"""`RequestOutputCollector`: one consumer, woken by each put, never blocked by a cancelled one."""

from __future__ import annotations

import asyncio

import pytest

from shoal.client.api.output_processor import RequestOutputCollector
from shoal.client.api.outputs import CompletionOutput, RequestMetrics, RequestOutput
from shoal.engine.protocol import RequestOutputKind


def _output(text: str, token_id: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index=0, text=text, token_ids=[token_id])
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1],
        outputs=[completion],
        finished=finished,
        metrics=RequestMetrics(arrival_time=0.0),
        new_token_ids=[token_id],
    )


async def test_a_waiting_consumer_is_woken_by_put() -> None:
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    getter = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    assert not getter.done()
    collector.put(_output("a", 1))
    got = await asyncio.wait_for(getter, 1.0)
    assert got.outputs[0].text == "a"


async def test_deltas_merge_while_nobody_reads() -> None:
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(_output("a", 1))
    collector.put(_output("b", 2, finished=True))
    got = await collector.get()
    assert (got.outputs[0].text, got.outputs[0].token_ids, got.finished) == ("ab", [1, 2], True)
    assert got.new_token_ids == [1, 2]


async def test_a_cancelled_consumer_does_not_break_later_puts_and_gets() -> None:
    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    getter = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    collector.put(_output("late", 3))
    got = await asyncio.wait_for(collector.get(), 1.0)
    assert got.outputs[0].text == "late"


async def test_an_error_reaches_the_consumer() -> None:
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    getter = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    collector.put(RuntimeError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        await asyncio.wait_for(getter, 1.0)
