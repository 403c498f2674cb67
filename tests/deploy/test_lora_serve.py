"""LoRA through a real `shoal serve` (two ranks of a tiny Llama on a `ray start --head` node,
`--enable-lora --max-loras 2`, four adapters from `--lora-modules`) and the official `openai`
client: greedy outputs equal the offline engine's with the same adapter, and routing keeps each
adapter on one rank, so each loads once (counted in `/metrics`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shoal import LLM, LoRARequest, SamplingParams
from tests.deploy.openai_utils import API_KEY, MODEL_NAME, FrontEnd, scrape, start_shoal, total
from tests.factories import make_tiny_checkpoint
from tests.lora_factories import make_lora_adapter
from tests.ray_utils import TINY_ENGINE_FLAGS, RayHead, ray_head, unique_namespace

__all__ = ["ray_head"]

pytestmark = pytest.mark.slow

NAMES = ("a", "b", "c", "d")
PROMPT = [5, 9, 14, 3, 22, 7]
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-serve")
    base = make_tiny_checkpoint(root / "base", "llama", seed=21)
    adapters = {n: make_lora_adapter(root / n, base, seed=30 + i) for i, n in enumerate(NAMES)}
    return {"base": base, **adapters}


@pytest.fixture(scope="module")
def served(
    ray_head: RayHead, files: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontEnd]:
    args = [
        "serve", "--model", files["base"], "--data-parallel-size", "2",
        "--namespace", unique_namespace("lora"), "--data-parallel-address", "127.0.0.1",
        "--host", "127.0.0.1", "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
        *TINY_ENGINE_FLAGS, *LORA_FLAGS,
        "--lora-modules", *(f"{n}={files[n]}" for n in NAMES),
    ]  # fmt: skip
    log: Path = tmp_path_factory.mktemp("logs") / "serve.log"
    front_end = start_shoal(ray_head, args, log)
    try:
        yield front_end
    finally:
        assert front_end.stop() == 0, front_end.output()


def test_adapters_match_the_offline_engine_and_load_once_each(
    served: FrontEnd, files: dict[str, str]
) -> None:
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0)
    texts: dict[str, str] = {}
    for _ in range(3):
        for name in NAMES:
            response = client.completions.create(
                model=name, prompt=PROMPT, max_tokens=6, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert texts.setdefault(name, response.choices[0].text) == response.choices[0].text
    samples = scrape(served.base_url)
    assert total(samples, "shoal:lora_adapter_loads_total") == len(NAMES), samples
    assert total(samples, "shoal:routing_decisions_total", reason="lora") >= 2 * len(NAMES)
    offline = LLM(files["base"], max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, name in enumerate(NAMES):
            lora = LoRARequest(name, i + 1, files[name])
            out = offline.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False,
                                   lora_request=lora)[0]  # fmt: skip
            assert out.outputs[0].text == texts[name], name
    finally:
        offline.shutdown()
