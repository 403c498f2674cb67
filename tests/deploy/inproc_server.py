"""The real OpenAI front end (`build_app`) over a local `AsyncLLM` (one engine process, no Ray),
served by uvicorn on a free port in a thread: for tests of the request bodies and their
outputs, which need neither a cluster nor a `shoal` process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from shoal.client.api.async_llm import AsyncLLM
from shoal.deploy.openai.app import build_app
from shoal.deploy.openai.limits import FrontEndLimits
from shoal.deploy.openai.lora import LoRAModule, serve_lora_modules
from shoal.deploy.openai.state import ServerState
from shoal.deploy.openai.tools import ToolCallConfig
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import free_port

MODEL_NAME = "tiny"
_READY_TIMEOUT_S = 120.0

# A ChatML template that renders `tools` as Qwen's does (the Hermes call format).
HERMES_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def set_chat_template(checkpoint: str, template: str) -> None:
    """Replaces the chat template in a checkpoint's tokenizer_config.json."""
    path = Path(checkpoint) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))


@contextlib.contextmanager
def serving_in_process(
    checkpoint: str,
    tool_calls: ToolCallConfig | None = None,
    *,
    model_name: str = MODEL_NAME,
    api_key: str | None = None,
    limits: FrontEndLimits | None = None,
    lora_modules: Sequence[LoRAModule] = (),
    **engine_kwargs: Any,
) -> Iterator[str]:
    """Serves `checkpoint` as `model_name` (requests need `api_key`, if given; so do the admin
    endpoints) and `lora_modules` until the block exits; yields the base URL (…/v1 not
    included)."""
    port = free_port()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        kwargs = {"max_model_len": 256, "num_gpu_blocks_override": 64, **engine_kwargs}
        llm = AsyncLLM(checkpoint, **kwargs)
        state = ServerState.make(llm, model_name, api_key, limits=limits)
        state.loras = serve_lora_modules(lora_modules, llm.config.lora, (model_name,))
        if tool_calls is not None:
            state.tool_calls = tool_calls
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        holder["server"] = server
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        ready.set()
        try:
            await task
        finally:
            await llm.aclose()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced by the waiting test
            holder["error"] = e
            ready.set()

    thread = threading.Thread(target=run, name="inproc-openai", daemon=True)
    thread.start()
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not ready.wait(0.1):
        assert time.monotonic() < deadline, "the in-process front end did not start"
    if "error" in holder:
        raise holder["error"]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        holder["server"].should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serving_tiny_with_tools(base_dir: Path) -> Iterator[str]:
    """A tiny checkpoint whose template renders tools, served with `auto` tool choice (the
    hermes parser) and a context that holds the rendered tools."""
    checkpoint = make_tiny_checkpoint(base_dir, "llama", max_position_embeddings=1024)
    set_chat_template(checkpoint, HERMES_TOOLS_TEMPLATE)
    tool_calls = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serving_in_process(
        checkpoint, tool_calls, max_model_len=1024, num_gpu_blocks_override=512
    ) as url:
        yield url
