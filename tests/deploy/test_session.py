"""Which session an HTTP request belongs to (`shoal.deploy.openai.session`)."""

from __future__ import annotations

import pytest

from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.session import MAX_SESSION_ID_CHARS, session_id


def test_the_header_wins_over_the_user_field() -> None:
    assert session_id({"x-session-id": "conv-1"}, "alice") == "conv-1"
    assert session_id({}, "alice") == "alice"
    assert session_id({}, None) is None
    assert session_id({"x-session-id": ""}, "") is None


def test_an_overlong_session_id_is_a_bad_request() -> None:
    with pytest.raises(OpenAIError, match="X-Session-ID must be at most") as error:
        session_id({"x-session-id": "s" * (MAX_SESSION_ID_CHARS + 1)}, None)
    assert error.value.status == 400
    with pytest.raises(OpenAIError, match="user must be at most") as error:
        session_id({}, "u" * (MAX_SESSION_ID_CHARS + 1))
    assert error.value.param == "user"
