"""`POST /v1/embeddings`: each input's pooled final hidden state, from a pooling engine.

Served when the model runs with `--runner pooling` (or `--convert embed`): every input (a
string, a list of strings, token ids, or a list of those) becomes one pooling request,
tokenized off the event loop, admitted together by the caller's tenant (`admission`: the
inputs' tokens, one sequence each), all of them run at once; the answer lists the vectors in input
order, as floats or, with `encoding_format: base64` (what the official `openai` client asks
for by default), as the base64 of their little-endian float32 bytes. A model served for
generation answers 400, naming the flags that serve it for embeddings. `dimensions` is
refused: no served model is trained to be truncated (Matryoshka).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from shoal.client.api.outputs import EmbeddingRequestOutput
from shoal.client.api.prompts import PromptType, TokenizedPrompt, tokenize_prompt
from shoal.deploy.openai.admission import Work
from shoal.deploy.openai.admission_gate import Caller
from shoal.deploy.openai.errors import OpenAIError, from_exception
from shoal.deploy.openai.protocol import LenientBody, UsageInfo
from shoal.deploy.openai.state import ServerState
from shoal.engine.protocol import PoolingParams

# The most inputs one request may batch (as completions' prompts).
MAX_INPUTS = 1024

NOT_AN_EMBEDDING_MODEL = (
    "this model is served for generation, not embeddings; serve it for embeddings with "
    "`shoal serve MODEL --runner pooling` (vLLM's flag; `--convert embed` does the same), "
    """and `--pooler-config '{"pooling_type": "MEAN"}'` for mean pooling (default: last token)"""
)


class EmbeddingRequest(LenientBody):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def _inputs(request: EmbeddingRequest) -> list[PromptType]:
    given = request.input
    if isinstance(given, str):
        return [given]
    if not given:
        raise OpenAIError("input must not be empty", param="input")
    if all(isinstance(t, int) for t in given):
        return [list(given)]  # type: ignore[arg-type]
    if len(given) > MAX_INPUTS:
        raise OpenAIError(f"a batch holds at most {MAX_INPUTS} inputs", param="input")
    if any(not item for item in given):
        raise OpenAIError("input must not hold an empty item", param="input")
    return list(given)  # type: ignore[arg-type]


async def _tokenized(state: ServerState, prompt: PromptType) -> TokenizedPrompt:
    """The one prompt form (`TokenizedPrompt`), a text tokenized off the event loop."""
    if isinstance(prompt, str):
        state.pool.check_text_length(len(prompt), state.max_model_len, "input")
        tokenized: TokenizedPrompt = await state.pool.run(
            tokenize_prompt, state.tokenizer, prompt, size=len(prompt)
        )
        return tokenized
    return tokenize_prompt(state.tokenizer, prompt)


async def _embed(state: ServerState, prompt: TokenizedPrompt) -> EmbeddingRequestOutput:
    async for output in state.llm.encode(prompt, PoolingParams()):
        if output.metrics is not None:  # counted as a served request, with no output tokens
            state.metrics.observe_sequence(
                output.data_parallel_rank,
                num_prompt_tokens=len(output.prompt_token_ids),
                num_generation_tokens=0,
                finish_reason="stop",
                metrics=output.metrics,
            )
        return output
    raise AssertionError("a pooling request ends with one output")


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(
    state: ServerState, request: EmbeddingRequest, caller: Caller
) -> JSONResponse:
    """Raises OpenAIError: not an embedding model, bad input, or an engine refusal (400); the
    tenant's queue full (429), the front end's (503)."""
    if state.check_model(request.model) is not None:
        raise OpenAIError("LoRA adapters serve generation only", param="model")
    if not state.llm.config.model.is_pooling:
        raise OpenAIError(NOT_AN_EMBEDDING_MODEL, param="model", code="not_an_embedding_model")
    if request.dimensions is not None:
        raise OpenAIError(
            "dimensions is not supported: the served model's embeddings are not trained to be "
            "truncated",
            param="dimensions",
        )
    inputs = _inputs(request)
    state.limits.check_num_sequences(len(inputs), f"{len(inputs)} inputs", param="input")
    prompts = [await _tokenized(state, p) for p in inputs]
    work = Work(sum(len(p.token_ids) for p in prompts), len(prompts))
    caller.tickets.append(await state.admission.admit(caller.tenant, work))
    results = await asyncio.gather(*(_embed(state, p) for p in prompts), return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        if not isinstance(failure, Exception):
            raise failure
        raise from_exception(failure) from failure
    outputs = [r for r in results if isinstance(r, EmbeddingRequestOutput)]
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    response = EmbeddingResponse(
        model=state.model_name,
        data=[
            EmbeddingData(index=i, embedding=_encode(o.outputs.embedding, request.encoding_format))
            for i, o in enumerate(outputs)
        ],
        usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return JSONResponse(response.model_dump())
