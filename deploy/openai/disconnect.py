"""A non-streamed generation ends when its client goes away.

A streamed response notices a closed connection itself (Starlette stops the stream and the
generation's generators close, which aborts its engine requests). A non-streamed one would run
to its last token for nobody, holding a batch slot and KV blocks. So its handler runs beside a
watch on the connection:

    RUNNING ──the handler returns──▶ the response is sent; the watch is cancelled
    RUNNING ──http.disconnect (the body is already read)──▶ the handler is cancelled: its
        generations close and their engine requests are aborted; 499 goes to the closed socket
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from fastapi import Request, Response

# nginx's "client closed request": nobody reads it, it only shows in access logs.
CLIENT_CLOSED_REQUEST = 499


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """`work`'s response, or 499 once the client has disconnected first (`work` cancelled)."""
    handler = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({handler, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if handler.done():
        return handler.result()
    handler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await handler
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
