"""The FastAPI app of one front end: OpenAI's and vLLM's endpoints over a `ServerState`.

    GET  /v1/models               the served model
    POST /v1/completions          text completions, streamed (SSE) or not
    POST /v1/chat/completions     chat completions, streamed (SSE) or not
    POST /v1/responses            OpenAI's Responses API, stateless, streamed or not (`responses`)
    POST /v1/embeddings           pooled hidden states, from a pooling engine (`embeddings`)
    POST /tokenize, /detokenize   the model's tokenizer
    GET  /health                  200 while a rank serves, else 503 (with the reason)
    GET  /metrics                 Prometheus text (see `shoal.deploy.metrics`)
    GET  /version, /load          shoal's version; requests in progress here
    POST /scale_elastic_ep        resize the cluster while it serves (see `elastic`)
    GET  /is_scaling_elastic_ep   whether a resize runs

With API keys, every `/v1/*` request, `/tokenize`, `/detokenize` and `/openapi.json` need
`Authorization: Bearer KEY` with one of them (else 401): the key names the request's tenant
(`tenants`), whose fair share the completions endpoints are admitted by (`admission`). The
resize endpoints need the admin key (`--admin-api-key`, by default the API key when there is
one). `/health`, `/metrics`, `/version` and `/load` stay open, for probes and
scrapers. (vLLM leaves /tokenize open; here it is work a client can ask for, so it is keyed.)
Every body is read, capped, before the app parses it (`body_guard`). While no cluster serves
the front end (it follows its cluster: `follow`), every request that needs one gets a 503 that
says why, before its body is read.
"""

from __future__ import annotations

import hmac
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal import __version__
from shoal.deploy.metrics import CONTENT_TYPE
from shoal.deploy.openai.admission_gate import Caller
from shoal.deploy.openai.body_guard import BodyGuard
from shoal.deploy.openai.chat import create_chat_completion
from shoal.deploy.openai.completions import create_completion
from shoal.deploy.openai.disconnect import unless_disconnected
from shoal.deploy.openai.elastic import is_scaling_elastic_ep, scale_elastic_ep
from shoal.deploy.openai.embeddings import EmbeddingRequest, create_embedding
from shoal.deploy.openai.errors import OpenAIError, error_response, install_handlers
from shoal.deploy.openai.lora_routes import LORA_ADMIN_PATHS, add_lora_routes, lora_cards
from shoal.deploy.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    IsScalingElasticEPResponse,
    ModelCard,
    ModelList,
    ScaleElasticEPRequest,
    ScaleElasticEPResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from shoal.deploy.openai.responses import create_response
from shoal.deploy.openai.responses_protocol import ResponsesRequest
from shoal.deploy.openai.session import session_id
from shoal.deploy.openai.state import ServerState
from shoal.deploy.openai.tenants import DEFAULT_TENANT
from shoal.deploy.openai.tokenization import detokenize, tokenize

# The admin endpoints: they change the cluster or what it serves, so they need the admin key.
ADMIN_PATHS = frozenset({"/scale_elastic_ep", "/is_scaling_elastic_ep"}) | LORA_ADMIN_PATHS
# Outside /v1/, the endpoints that need the API key: they do work, or describe the API.
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/openapi.json"})


def needs_api_key(path: str) -> bool:
    """Whether a request to `path` needs the API key (when the server has one)."""
    return path.startswith("/v1/") or path.rstrip("/") in KEYED_PATHS


def needs_admin_key(path: str) -> bool:
    """Whether a request to `path` needs the admin key (when the server has one)."""
    return path.rstrip("/") in ADMIN_PATHS


def needs_cluster(path: str) -> bool:
    """Whether a request to `path` needs a cluster serving the front end."""
    trimmed = path.rstrip("/")
    return path.startswith("/v1/") or trimmed in ADMIN_PATHS or trimmed in _TOKENIZER_PATHS


_TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})


# Where the front door leaves a request's `Caller` in its ASGI scope.
CALLER_SCOPE_KEY = "shoal.caller"


class _FrontDoor:
    """Pure ASGI middleware: the key checks (`needs_api_key`, `needs_admin_key`), the
    request's tenant (a `Caller` in its scope, whose admission tickets it releases when the
    request ends), and the count of requests in progress (a streamed response counts until
    its last byte)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        assert state.tenants is not None, "ServerState makes its tenant table"
        self._tenants = state.tenants
        self._expected_admin = _bearer(state.admin_api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        caller = self._caller(scope)
        if isinstance(caller, OpenAIError):
            await error_response(caller)(scope, receive, send)
            return
        if self.state.current_llm is None and needs_cluster(scope["path"]):
            await error_response(self.state.not_serving_error())(scope, receive, send)
            return
        scope[CALLER_SCOPE_KEY] = caller
        is_work = scope["method"] == "POST"
        self.state.num_in_flight += is_work
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= is_work
            caller.release()

    def _caller(self, scope: Scope) -> Caller | OpenAIError:
        """Who sent the request, or the 401 for a missing or wrong key."""
        path = scope["path"]
        given = dict(scope["headers"]).get(b"authorization", b"")
        if needs_admin_key(path):
            if self._expected_admin is None and self._tenants.has_keys:
                return OpenAIError(  # several tenants' keys and no admin key: closed
                    "the admin endpoints need the admin key, and this server has none "
                    "(--admin-api-key-file)",
                    HTTPStatus.UNAUTHORIZED,
                )
            if self._expected_admin is None or hmac.compare_digest(given, self._expected_admin):
                return Caller(DEFAULT_TENANT)
            return _UNAUTHORIZED
        if not needs_api_key(path):
            return Caller(DEFAULT_TENANT)
        tenant = self._tenants.lookup(given)
        return _UNAUTHORIZED if tenant is None else Caller(tenant.name)


_UNAUTHORIZED = OpenAIError("invalid or missing API key", HTTPStatus.UNAUTHORIZED)


def _bearer(key: str | None) -> bytes | None:
    return f"Bearer {key}".encode() if key else None


def _caller(raw: Request) -> Caller:
    """The caller the front door found for a request."""
    caller: Any = raw.scope[CALLER_SCOPE_KEY]
    assert isinstance(caller, Caller), "the front door runs before every endpoint"
    return caller


def _session_and_caller(raw: Request, user: str | None) -> tuple[str | None, Caller]:
    """A generation request's session (`session.py`) and its caller."""
    return session_id(raw.headers, user), _caller(raw)


def build_app(state: ServerState) -> FastAPI:
    """The app serving `state`'s model."""
    app = FastAPI(title="shoal", version=__version__, docs_url=None, redoc_url=None)
    install_handlers(app)
    # The last added runs first: keys are checked before a body is read.
    app.add_middleware(BodyGuard, max_body_bytes=state.limits.max_request_body_bytes)
    app.add_middleware(_FrontDoor, state=state)

    @app.get("/health")
    async def health() -> Response:
        if state.serving_ranks():
            return Response(status_code=int(HTTPStatus.OK))
        if state.current_llm is None:
            return error_response(state.not_serving_error())
        error = OpenAIError("no rank of the cluster serves now", HTTPStatus.SERVICE_UNAVAILABLE)
        return error_response(error)

    @app.get("/metrics")
    async def metrics() -> Response:
        await state.refresh_cluster_facts()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": state.num_in_flight}

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=state.model_name,
            root=state.llm.config.model.model,
            max_model_len=state.max_model_len,
        )
        return ModelList(data=[card, *lora_cards(state)])

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        work = create_completion(state, request, *_session_and_caller(raw, request.user))
        return await unless_disconnected(raw, work)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        work = create_chat_completion(state, request, *_session_and_caller(raw, request.user))
        return await unless_disconnected(raw, work)

    @app.post("/v1/responses")
    async def responses(request: ResponsesRequest, raw: Request) -> Response:
        work = create_response(state, request, *_session_and_caller(raw, request.user))
        return await unless_disconnected(raw, work)

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw: Request) -> Response:
        return await unless_disconnected(raw, create_embedding(state, request, _caller(raw)))

    add_lora_routes(app, state)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(request: TokenizeRequest) -> Response:
        return await tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize_route(request: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(state, request)

    @app.post("/scale_elastic_ep")
    async def scale_route(request: ScaleElasticEPRequest) -> ScaleElasticEPResponse:
        return await scale_elastic_ep(state, request)

    # GET, and POST as vLLM's server answers it.
    @app.api_route("/is_scaling_elastic_ep", methods=["GET", "POST"])
    async def is_scaling_route() -> IsScalingElasticEPResponse:
        return await is_scaling_elastic_ep(state)

    return app
