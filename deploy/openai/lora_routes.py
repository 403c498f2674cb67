"""The LoRA endpoints of the front end: `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (the admin key's, `app.ADMIN_PATHS`), and the adapters' cards in
`/v1/models`, each with its base as `parent`."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from shoal.deploy.openai.lora import LoadLoRAAdapterRequest, LoRAModule, UnloadLoRAAdapterRequest
from shoal.deploy.openai.protocol import ModelCard
from shoal.deploy.openai.state import ServerState

LORA_ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def lora_cards(state: ServerState) -> list[ModelCard]:
    """One card per served adapter: its folder as `root`, its base as `parent`."""
    return [
        ModelCard(id=lora.lora_name, root=lora.lora_path, parent=parent)
        for lora, parent in state.loras.parents(state.model_name)
    ]


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """Adds the load and unload endpoints (their key is checked by the front door)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        module = LoRAModule(request.lora_name, request.lora_path)
        taken = (state.model_name, *state.served_model_names)
        state.loras.add(module, state.llm.config.lora, taken)
        return PlainTextResponse(f"LoRA adapter `{request.lora_name}` is served")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        state.loras.remove(request.lora_name)
        return PlainTextResponse(f"LoRA adapter `{request.lora_name}` is no longer served")
