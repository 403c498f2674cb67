"""`n > 1`: one request fanned out to n engine requests, their outputs merged into one.

Engines only ever run single sequences. A request asking for n of them becomes n children,
each with `n=1` (and, when the parent has a seed, the seed `seed + i`, so the children differ
yet the whole stays reproducible); their outputs come back as one `RequestOutput` whose
`outputs` are the children's `CompletionOutput`s with `index` 0..n-1. Shared by `LLM` (final
outputs) and `AsyncLLM` (streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from shoal.client.api.outputs import RequestOutput
from shoal.engine.protocol import RequestOutputKind, SamplingParams

# A child stream: (child params, child request id) -> its outputs.
ChildStream = Callable[[SamplingParams, str], AsyncGenerator[RequestOutput, None]]


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The n single-sequence params a request with `params.n` sequences runs as."""
    if params.n == 1:
        return [params]
    return [
        msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def merge_outputs(request_id: str, children: list[RequestOutput]) -> RequestOutput:
    """One `RequestOutput` of the parent from its children's latest outputs (in index order)."""
    first = children[0]
    completions = [
        dataclasses.replace(child.outputs[0], index=i) for i, child in enumerate(children)
    ]
    return dataclasses.replace(
        first,
        request_id=request_id,
        outputs=completions,
        finished=all(child.finished for child in children),
        error=next((c.error for c in children if c.error is not None), None),
        num_cached_tokens=max(c.num_cached_tokens for c in children),
        new_token_ids=[t for c in children for t in c.new_token_ids],
    )


async def generate_fan_out(
    generate_one: ChildStream, params: SamplingParams, request_id: str
) -> AsyncGenerator[RequestOutput, None]:
    """Runs `params.n` children concurrently and streams the parent's outputs.

    DELTA: each output carries only the child that produced something, with its index.
    CUMULATIVE: each output carries every child's latest state. FINAL_ONLY: one output, once
    every child has finished. Closing the stream (or an error in one child) aborts the others.

    Raises:
        whatever a child's stream raises (RequestError, EngineDeadError).
    """
    params_list = child_params(params)
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, child: SamplingParams) -> None:
        try:
            stream = generate_one(child, child_request_id(request_id, index))
            async with contextlib.aclosing(stream) as outputs:
                async for output in outputs:
                    queue.put_nowait((index, output))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((index, e))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(params_list)]
    latest: list[RequestOutput | None] = [None] * len(tasks)
    # Counted as outputs arrive, so each output costs O(1), not O(n): a request's cost stays
    # linear in n.
    num_started = num_finished = 0
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            previous, latest[index] = latest[index], item
            num_started += previous is None
            num_finished += item.finished and not (previous is not None and previous.finished)
            kind = params.output_kind
            if kind == RequestOutputKind.DELTA:
                yield _with_index(request_id, item, index, num_finished == len(latest))
            elif kind == RequestOutputKind.CUMULATIVE and num_started == len(latest):
                yield merge_outputs(request_id, _known(latest))
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            yield merge_outputs(request_id, _known(latest))
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


def _with_index(
    request_id: str, output: RequestOutput, index: int, finished: bool
) -> RequestOutput:
    completion = dataclasses.replace(output.outputs[0], index=index)
    return dataclasses.replace(
        output, request_id=request_id, outputs=[completion], finished=finished
    )


def _known(outputs: list[Any]) -> list[RequestOutput]:
    assert all(o is not None for o in outputs), "every child has produced an output"
    return list(outputs)
