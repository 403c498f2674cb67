"""LoRA adapters through the OpenAI front end, with the official `openai` client: a request's
`model` picks an adapter (completions and chat), `/v1/models` lists the adapters under their
base, adapters load and unload at run time with the admin key, an unknown name is a 404 and an
adapter that does not fit a 400; `LLM.generate(lora_request=)` equals HF with the adapter
merged by hand."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from shoal import LLM, LoRARequest, SamplingParams
from shoal.deploy import cli
from shoal.deploy.metrics import ServerMetrics
from shoal.deploy.openai.lora import LoRAModule, parse_lora_module
from shoal.deploy.openai.server import front_end_config
from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.protocol import EngineCoreRequest
from tests.deploy.inproc_server import serving_in_process
from tests.factories import hf_reference, make_tiny_checkpoint
from tests.lora_factories import ATTENTION_MODULES, make_lora_adapter, merged_reference
from tests.ray_utils import free_port
from tests.reference import assert_greedy_matches, hf_greedy

API_KEY = "lora-key"
MODEL = "tiny"
ENGINE: dict[str, Any] = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
PROMPT = [5, 9, 14, 3, 22, 7, 31, 2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_checkpoint(root / "base", "llama", seed=11)
    return {
        "base": base,
        "sql": make_lora_adapter(root / "sql", base, seed=12, rank=4),
        "chat": make_lora_adapter(root / "chat", base, target_modules=ATTENTION_MODULES, seed=13),
        "late": make_lora_adapter(root / "late", base, seed=14, rank=2),
        "too-big": make_lora_adapter(root / "too-big", base, seed=15, rank=16),
        "head": make_lora_adapter(root / "head", base, target_modules=("lm_head",), seed=16),
    }


@pytest.fixture(scope="module")
def reference(files: dict[str, str]) -> Iterator[LLM]:
    llm = LLM(files["base"], max_model_len=256, num_gpu_blocks_override=64, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def url(files: dict[str, str]) -> Iterator[str]:
    modules = [
        LoRAModule("sql", files["sql"]),
        LoRAModule("chat", files["chat"], base_model_name="tiny-base"),
    ]
    with serving_in_process(
        files["base"], model_name=MODEL, api_key=API_KEY, lora_modules=modules, **ENGINE
    ) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def _lora(files: dict[str, str], name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, files[name])


def test_llm_generate_with_adapters_equals_hf_merged(reference: LLM, files: dict[str, str]) -> None:
    loras = [_lora(files, "sql", 1), None, _lora(files, "chat", 2)]
    outputs = reference.generate(
        [{"prompt_token_ids": PROMPT}] * 3, GREEDY, use_tqdm=False, lora_request=loras
    )
    models = [
        merged_reference(files["base"], files["sql"]),
        hf_reference(files["base"]),
        merged_reference(files["base"], files["chat"]),
    ]
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    for i, (model, got) in enumerate(zip(models, tokens, strict=True)):
        assert_greedy_matches(got, hf_greedy(model, PROMPT, 10), label=f"request {i}")
    assert tokens[0] != tokens[1] and tokens[2] != tokens[1]


def _complete(client: openai.OpenAI, model: str) -> str:
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return response.choices[0].text


def test_the_model_name_picks_the_adapter(
    client: openai.OpenAI, reference: LLM, files: dict[str, str]
) -> None:
    for name, lora in [("sql", _lora(files, "sql", 1)), ("chat", _lora(files, "chat", 2))]:
        expected = reference.generate(
            [{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False, lora_request=lora
        )[0]
        assert _complete(client, name) == expected.outputs[0].text
    base = reference.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0]
    assert _complete(client, MODEL) == base.outputs[0].text != _complete(client, "sql")
    messages = [{"role": "user", "content": "Say something."}]
    chat = reference.chat(messages, GREEDY, use_tqdm=False, lora_request=_lora(files, "chat", 2))
    response = client.chat.completions.create(
        model="chat", messages=messages, max_tokens=10, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.choices[0].message.content == chat[0].outputs[0].text


def test_models_lists_adapters_under_their_parent(client: openai.OpenAI) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards["sql"]["parent"] == MODEL and cards["chat"]["parent"] == "tiny-base"
    assert cards[MODEL].get("parent") is None


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _complete(client, "nobody")


def test_adapters_load_and_unload_at_run_time_with_the_admin_key(
    url: str, client: openai.OpenAI, files: dict[str, str]
) -> None:
    body = {"lora_name": "late", "lora_path": files["late"]}
    with pytest.raises(openai.AuthenticationError):
        _admin(url, "load_lora_adapter", body, key="wrong")
    _admin(url, "load_lora_adapter", body)
    assert "late" in {m.id for m in client.models.list().data}
    assert _complete(client, "late") != _complete(client, MODEL)
    with pytest.raises(openai.BadRequestError, match="is taken"):
        _admin(url, "load_lora_adapter", body)
    with pytest.raises(openai.BadRequestError, match="above --max-lora-rank 8"):
        _admin(url, "load_lora_adapter", {"lora_name": "big", "lora_path": files["too-big"]})
    with pytest.raises(openai.BadRequestError, match="is not a directory"):
        _admin(url, "load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    # Its modules are checked against the base by the engine: that request alone fails.
    _admin(url, "load_lora_adapter", {"lora_name": "head", "lora_path": files["head"]})
    with pytest.raises(openai.BadRequestError, match="cannot adapt"):
        _complete(client, "head")
    assert _complete(client, "late") != ""
    _admin(url, "unload_lora_adapter", {"lora_name": "late"})
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")
    with pytest.raises(openai.NotFoundError, match="not loaded"):
        _admin(url, "unload_lora_adapter", {"lora_name": "late"})


def _admin(url: str, path: str, body: dict[str, str], key: str = API_KEY) -> None:
    """POSTs to an admin endpoint with the `openai` client's transport and error mapping."""
    admin = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    admin.post(f"/v1/{path}", body=body, cast_to=str)


def test_lora_modules_flag_takes_both_forms(tmp_path: Path) -> None:
    spec = json.dumps({"name": "b", "path": "/p/b", "base_model_name": "base"})
    args = cli.build_parser().parse_args(
        ["serve", "/m", "--enable-lora", "--port", "8000", "--lora-modules", "a=/p/a", spec]
    )
    config = front_end_config(args, 8000)
    assert config.lora_modules == (LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b", "base"))
    assert args.enable_lora is True
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("just-a-name")


def test_metrics_show_each_ranks_slots_and_loads(files: dict[str, str]) -> None:
    """From a real engine's stats, as a cluster's front end reads them per rank."""
    core = EngineCore(EngineConfig.from_kwargs(files["base"], max_model_len=128, **ENGINE))
    for i, name in enumerate(["sql", "chat"]):
        params = SamplingParams(temperature=0.0, max_tokens=2)
        core.add_request(
            EngineCoreRequest(name, PROMPT, params, lora_request=_lora(files, name, i))
        )
    core.step()  # both running
    during = core.scheduler.make_stats()
    while core.has_unfinished_requests():
        core.step()
    stats = {0: during, 1: core.scheduler.make_stats()}
    text = ServerMetrics(MODEL, lambda: stats).render().decode()
    info = sorted(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
    assert len(info) == 2 and all('max_lora="2"' in line for line in info), info
    assert 'running_lora_adapters="chat,sql"' in info[0] and 'engine="0"' in info[0]
    assert 'running_lora_adapters=""' in info[1]
    loads = [
        line for line in text.splitlines() if line.startswith("shoal:lora_adapter_loads_total")
    ]
    assert [float(line.rsplit(" ", 1)[1]) for line in loads] == [2.0, 2.0], loads

    def values(name: str) -> list[float]:
        return [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name)]

    assert values("shoal:lora_adapter_evictions_total") == [0.0, 0.0]  # two slots, two adapters
    seconds = values("shoal:lora_adapter_load_seconds_total")
    assert len(seconds) == 2 and seconds[0] > 0 and seconds[0] == seconds[1], seconds


def test_load_and_unload_under_load_fail_no_other_request(
    url: str, client: openai.OpenAI, files: dict[str, str]
) -> None:
    """Streams of the base and of adapters are mid-way when adapters load and unload."""
    models = [MODEL, "sql", "chat", MODEL, "sql"]
    streams = [
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=48,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for model in models
    ]
    firsts = [next(iter(stream)) for stream in streams]  # every one has started
    _admin(url, "load_lora_adapter", {"lora_name": "extra", "lora_path": files["late"]})
    _admin(url, "unload_lora_adapter", {"lora_name": "chat"})
    assert _complete(client, "extra")
    finish_reasons = []
    for first, stream in zip(firsts, streams, strict=True):
        chunks = [first, *stream]
        finish_reasons.append([c.choices[0].finish_reason for c in chunks if c.choices][-1])
    assert finish_reasons == ["length"] * len(models)
    _admin(url, "load_lora_adapter", {"lora_name": "chat", "lora_path": files["chat"]})
    _admin(url, "unload_lora_adapter", {"lora_name": "extra"})


def test_serve_refuses_an_adapter_that_cannot_serve_before_launching(
    files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    base = ["serve", files["base"], "--port", str(free_port()), "--namespace", "lora-refusals"]
    too_big = f"big={files['too-big']}"
    assert (
        cli.main([*base, "--enable-lora", "--max-lora-rank", "8", "--lora-modules", too_big]) == 2
    )
    assert cli.main([*base, "--lora-modules", f"sql={files['sql']}"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2, errors
    assert "--lora-modules big: the adapter at" in errors[0] and "--max-lora-rank 8" in errors[0]
    assert "--lora-modules sql: LoRA adapters need engines started with --enable-lora" in errors[1]
