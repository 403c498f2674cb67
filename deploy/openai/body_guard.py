"""`BodyGuard`: the ASGI layer that reads every request body before the app sees it, with a cap.

A body is refused before it is parsed:
- 413 when its `Content-Length` exceeds `max_body_bytes` (at once: nothing of it is read), or
  when a chunked body grows past the cap (reading stops there);
- 400 when its JSON carries a lone UTF-16 surrogate (`"\\ud800"`): text that is not Unicode
  would fail deep in the tokenizer or the response encoder instead.
The app then gets the whole body in one message; later `receive` calls (a disconnect) pass
through. How long a body may take to arrive is the connection's bound (`connections`).
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.deploy.openai.errors import OpenAIError, error_response

# A \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or the reverse: a cheap first
# look. A match may be a false alarm (an escaped backslash before "ud800"); `_has_lone_surrogate`
# decides.
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


class BodyGuard:
    """Pure ASGI middleware: buffers each request body up to `max_body_bytes` (see module)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(scope, receive)
        except OpenAIError as e:
            await error_response(e)(scope, receive, send)
            return
        if body is None:  # the client went away while sending
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None if the client disconnected first.

        Raises:
            OpenAIError: too large (413), or a lone surrogate in it (400).
        """
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise OpenAIError("Content-Length is not a number")
            if int(declared) > self.max_body_bytes:
                raise self._too_large()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if _LONE_SURROGATE.search(body) and _has_lone_surrogate(body):
            raise OpenAIError(
                "the request body holds text that is not valid Unicode (a lone UTF-16 "
                "surrogate escape)",
                code="invalid_unicode",
            )
        return body

    def _too_large(self) -> OpenAIError:
        return OpenAIError(
            f"the request body exceeds this server's limit of {self.max_body_bytes} bytes "
            "(--max-request-body-bytes)",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            code="request_too_large",
        )


def _has_lone_surrogate(body: bytes) -> bool:
    """Whether the JSON `body` decodes to a string with a lone surrogate (invalid JSON: no;
    the app refuses it itself)."""
    try:
        decoded = json.loads(body)
    except ValueError:
        return False
    try:
        json.dumps(decoded, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` whose first message is the whole `body`; then the connection's own."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
