"""Session affinity from an HTTP request: the `X-Session-ID` header, else the body's `user`.

A session keeps a conversation's turns on one rank while that rank's load allows (the router's
`SessionAffinityPolicy`), so each turn finds the previous ones in that rank's prefix cache.
"""

from __future__ import annotations

from collections.abc import Mapping

from shoal.deploy.openai.errors import OpenAIError

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 256


def session_id(headers: Mapping[str, str], user: str | None) -> str | None:
    """The request's session: the header if present, else `user`; None for neither.

    Raises:
        OpenAIError: a session id longer than MAX_SESSION_ID_CHARS (400).
    """
    session = headers.get(SESSION_HEADER) or user or None
    if session is not None and len(session) > MAX_SESSION_ID_CHARS:
        source = "X-Session-ID" if headers.get(SESSION_HEADER) else "user"
        raise OpenAIError(
            f"{source} must be at most {MAX_SESSION_ID_CHARS} characters, got {len(session)}",
            param=None if source == "X-Session-ID" else "user",
        )
    return session
