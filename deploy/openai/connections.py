"""Bounded HTTP connections: uvicorn's h11 protocol with a read deadline and a connection cap.

uvicorn alone closes a keep-alive connection only after a response and only while no byte
arrives, and holds any number of connections: a client that sends its headers a byte a
second, or that opens connections and says nothing, holds descriptors until the process
runs out. `guarded_protocol` adds, per connection:

1. A read deadline. From the moment the connection opens, and again from each response's
   last byte, the next request's head and body must arrive within `read_timeout_s`, else
   the connection is closed. (uvicorn's keep-alive timer still closes idle connections
   sooner, after `timeout_keep_alive`.)
2. A cap. At most `max_connections` stay open, set below the open-file limit. A connection
   past the cap first displaces the longest-idle one that has no request in progress (no
   bytes yet, headers still arriving, or keep-alive between requests); if every connection
   is serving a request, the newcomer gets an immediate 503 and is closed.
3. Quiet logs. Each kind of event (deadline, displacement, refusal, an error of the event
   loop such as accept() hitting the file limit) is logged at most once per interval with
   a count, never as a traceback per connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from shoal.deploy.openai.errors import OpenAIError, error_body
from shoal.engine.core.rate_limit import WARN_INTERVAL_S, LogRateLimiter

logger = logging.getLogger("shoal.api_server")
_warnings = LogRateLimiter(logger)

# Descriptors kept for everything else in the process (Ray, ZMQ, files).
_RESERVED_FILES = 256
# How long a refused connection may take to read its 503 before it is closed.
_REFUSED_LINGER_S = 1.0


def connection_cap(max_connections: int) -> int:
    """`max_connections`, lowered to leave `_RESERVED_FILES` of the open-file limit free."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return max_connections
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - _RESERVED_FILES))


def _refusal() -> bytes:
    error = OpenAIError(
        "the server holds as many connections as it may; retry shortly",
        HTTPStatus.SERVICE_UNAVAILABLE,
        code="too_many_connections",
    )
    body = json.dumps(error_body(error)).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
    )
    return head.encode() + body


_REFUSAL = _refusal()


class _Connections:
    """The open connections of one server, oldest-idle first (the displacement order)."""

    def __init__(self, cap: int, read_timeout_s: float) -> None:
        self.cap = cap
        self.read_timeout_s = read_timeout_s
        # Connections in the order they last became idle; one now busy is skipped (and
        # dropped) when met, and put back at the end when its response completes.
        self.idle_order: OrderedDict[GuardedH11Protocol, None] = OrderedDict()

    def mark_idle(self, connection: GuardedH11Protocol) -> None:
        self.idle_order.pop(connection, None)
        self.idle_order[connection] = None

    def forget(self, connection: GuardedH11Protocol) -> None:
        self.idle_order.pop(connection, None)

    def longest_idle(self, newcomer: GuardedH11Protocol) -> GuardedH11Protocol | None:
        """The connection to displace for `newcomer`, taken out of the order; None if every
        other connection is serving a request."""
        while self.idle_order:
            connection, _ = self.idle_order.popitem(last=False)
            if connection is not newcomer and connection.is_idle:
                return connection
        return None


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the read deadline and the cap (see module)."""

    _connections: _Connections  # set on the subclass `guarded_protocol` makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._is_refused = False

    @property
    def is_idle(self) -> bool:
        """Open, with no request being served: the next one has not fully arrived."""
        if self.transport is None or self.transport.is_closing():
            return False
        return self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._connections.cap:
            displaced = self._connections.longest_idle(self)
            if displaced is None:
                self._refuse()
                return
            _warnings.warning(
                "displaced",
                "closed an idle connection to admit a new one (at the cap of %d connections)",
                self._connections.cap,
            )
            displaced.close()
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.forget(self)
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._is_refused:
            return  # the 503 is on its way; what the client sends is dropped
        super().data_received(data)

    def eof_received(self) -> None:
        if self._is_refused:
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()

    def close(self) -> None:
        """Closes the connection now."""
        self._cancel_deadline()
        if not self.transport.is_closing():
            self.transport.close()

    def _await_request(self) -> None:
        self._connections.mark_idle(self)
        self._cancel_deadline()
        self._deadline = self.loop.call_later(
            self._connections.read_timeout_s, self._on_read_deadline
        )

    def _on_read_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        arrived = self.conn.their_state not in (h11.IDLE, h11.SEND_BODY)
        if arrived or (self.cycle is not None and self.cycle.response_started):
            return
        _warnings.warning(
            "read-deadline",
            "closed a connection whose request did not arrive within %.0f s",
            self._connections.read_timeout_s,
        )
        self.transport.close()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _refuse(self) -> None:
        self._is_refused = True
        self._connections.forget(self)
        _warnings.warning(
            "refused",
            "refused a connection with 503: all %d connections are serving requests",
            self._connections.cap,
        )
        self.transport.write(_REFUSAL)
        self._deadline = self.loop.call_later(_REFUSED_LINGER_S, self.transport.close)


def guarded_protocol(max_connections: int, read_timeout_s: float) -> type[GuardedH11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` that holds at most `max_connections`
    (see `connection_cap`) whose requests must arrive within `read_timeout_s`."""
    connections = _Connections(max_connections, read_timeout_s)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"_connections": connections})


class _RepeatLimit(logging.Filter):
    """Lets each message template of a logger through at most once per `interval_s`; the next
    one that passes says how many were held back (uvicorn logs "Invalid HTTP request
    received." once per bad request)."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._state: dict[str, tuple[float, int]] = {}  # template → (last passed, held back)

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = str(record.msg)
        last, held_back = self._state.get(key, (float("-inf"), 0))
        if now - last < self._interval_s:
            self._state[key] = (last, held_back + 1)
            return False
        if len(self._state) > 1024:
            self._state.clear()
        self._state[key] = (now, 0)
        if held_back:
            record.msg = f"{record.msg} (and {held_back} more like it)"
        return True


def quiet_loop_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Makes `loop` log each kind of error it catches (accept() out of descriptors, a
    callback that raised) once per interval with a count, without a traceback; and uvicorn's
    per-connection warnings likewise."""
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _RepeatLimit) for f in uvicorn_errors.filters):
        uvicorn_errors.addFilter(_RepeatLimit())

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "event loop error"))
        exception = context.get("exception")
        kind = f"{message}:{type(exception).__name__}"
        _warnings.warning(kind, "%s: %r", message, exception)

    loop.set_exception_handler(handle)
