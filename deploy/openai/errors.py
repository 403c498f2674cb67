"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and the status rules.

A client's mistake is a 400 (bad parameter, prompt over the limit), 401 (key), or 404 (model);
a request that may be what crashed an engine (`PoisonRequestError`) is a 400 too;
a resize asked for while another runs is a 409; a tenant whose queue is full gets a 429 (with
`Retry-After`); no serving rank, a resize rolled back, or a front end whose waiting room is full
(`Retry-After` too) is a 503. Only a fault of the server itself is a 500. `install_handlers` maps
the exceptions the endpoints raise (and FastAPI's validation errors) onto these bodies.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.client.routing.migration import PoisonRequestError
from shoal.engine.errors import EngineDeadError, RequestError

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error answered with OpenAI's body and `status`."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers  # e.g. a 429's or 503's `Retry-After`


def _default_type(status: HTTPStatus) -> str:
    if status == HTTPStatus.UNAUTHORIZED:
        return "authentication_error"
    if status == HTTPStatus.NOT_FOUND:
        return "NotFoundError"
    if status == HTTPStatus.CONFLICT:
        return "ConflictError"
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        return "RateLimitError"
    if status >= 500:
        return "ServiceUnavailableError" if status == 503 else "InternalServerError"
    return "BadRequestError"


def error_body(error: OpenAIError) -> dict[str, dict[str, str | int | None]]:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code or int(error.status),
        }
    }


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=int(error.status), headers=error.headers)


def from_exception(e: BaseException) -> OpenAIError:
    """The OpenAI error a failed generation answers with."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, (RequestError, ValueError)):
        return OpenAIError(str(e))
    if isinstance(e, PoisonRequestError):  # it may crash engines: the request is at fault
        return OpenAIError(str(e), code="poison_request")
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"no engine rank serves: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
    logger.exception("internal error", exc_info=e)
    return OpenAIError(f"internal error: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)


def install_handlers(app: FastAPI) -> None:
    """Every error the app answers with carries OpenAI's body."""

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: "
            f"{err.get('msg', 'invalid')}"
            for err in errors
        )
        param = ".".join(location) or None
        return error_response(OpenAIError(message or "invalid request body", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(OpenAIError(str(e.detail), HTTPStatus(e.status_code)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return error_response(from_exception(e))
