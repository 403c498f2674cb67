"""The OpenAI front end end to end: the official `openai` client against a real `shoal serve
--port` (two ranks of a tiny Llama on a `ray start --head` node), and a second front end
attached with `shoal api-server` serving the same cluster.

One cluster serves the whole module; the tests run in order and read `/metrics` as deltas.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from shoal import LLM, SamplingParams
from tests.deploy.openai_utils import (
    API_KEY,
    MODEL_NAME,
    FrontEnd,
    http_status,
    request_json,
    scrape,
    serving_two_ranks,
    start_shoal,
    total,
)
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import RayHead, ray_head, unique_namespace

__all__ = ["ray_head"]

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def namespace() -> str:
    return unique_namespace("openai")


@pytest.fixture(scope="module")
def served(
    ray_head: RayHead, checkpoint: str, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontEnd]:
    with serving_two_ranks(
        ray_head, checkpoint, namespace, tmp_path_factory.mktemp("logs")
    ) as front_end:
        yield front_end


@pytest.fixture(scope="module")
def client(served: FrontEnd) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> LLM:
    return LLM(checkpoint, num_gpu_blocks_override=64, max_model_len=256)


def test_models_health_version(served: FrontEnd, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http_status(f"{served.base_url}/health") == 200
    assert request_json(f"{served.base_url}/version")[1]["version"]
    assert request_json(f"{served.base_url}/load") == (200, {"server_load": 0})


def test_completions_greedy_equal_llm_generate_streamed_or_not(
    client: openai.OpenAI, reference: LLM
) -> None:
    expected = reference.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
    response = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12

    chunks = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == response.usage.prompt_tokens


def test_chat_greedy_equal_llm_chat_streamed_or_not(client: openai.OpenAI, reference: LLM) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    expected = reference.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    kwargs = {"model": MODEL_NAME, "messages": messages, "temperature": 0.0}
    response = client.chat.completions.create(
        **kwargs, max_completion_tokens=10, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 10

    stream = client.chat.completions.create(
        **kwargs,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.outputs[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_responses_greedy_equal_llm_chat_streamed_or_not(
    client: openai.OpenAI, reference: LLM
) -> None:
    expected = reference.chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say it."}],
        SamplingParams(temperature=0.0, max_tokens=10),
        use_tqdm=False,
    )[0]
    kwargs: Any = {
        "model": MODEL_NAME,
        "instructions": "Be brief.",
        "input": "Say it.",
        "temperature": 0.0,
        "max_output_tokens": 10,
    }
    response = client.responses.create(**kwargs)
    assert response.output_text == expected.outputs[0].text
    assert response.usage is not None
    assert response.usage.input_tokens == len(expected.prompt_token_ids)
    is_cut = expected.outputs[0].finish_reason == "length"
    assert response.status == ("incomplete" if is_cut else "completed")
    events = list(client.responses.create(**kwargs, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected.outputs[0].text
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )


def test_n2_stop_strings_and_logprobs(client: openai.OpenAI) -> None:
    two = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage is not None and two.usage.completion_tokens == 16
    assert two.choices[0].text != two.choices[1].text  # seeds 7 and 8

    greedy = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 3]
    assert stop.strip(), f"greedy text {greedy!r} gives no stop string"
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert stopped.finish_reason == "stop"
    assert stopped.text == greedy[: greedy.index(stop)]

    with_logprobs = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=2,
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    logprobs = with_logprobs.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 5 and logprobs.text_offset is not None
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.top_logprobs is not None
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs, strict=True
    ):
        assert logprob is not None and logprob <= 0.0
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob)  # greedy: argmax
        assert token in top

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0.0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert chat.logprobs is not None and chat.logprobs.content is not None
    assert len(chat.logprobs.content) == 4
    assert all(len(entry.top_logprobs) == 3 for entry in chat.logprobs.content)


BAD_BODIES = [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 99}, "logprobs"),
    ({"presence_penalty": 5.0}, "presence_penalty"),
    ({"min_p": 2.0}, "min_p"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),  # unknown fields are accepted: test_protocol.py
    ({"echo": True}, "echo"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 1000}, None),  # prompt + max_tokens over the 256-token context
    ({"prompt": [[]]}, "prompt"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_BODIES)
def test_bad_parameter_gets_400_and_the_server_keeps_serving(
    served: FrontEnd, extra: dict[str, object], param: str | None
) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **extra}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    status, response = request_json(f"{served.base_url}/v1/completions", body, headers)
    assert status == 400, response
    error = response["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"]
    ok = request_json(
        f"{served.base_url}/v1/completions",
        {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2},
        headers,
    )
    assert ok[0] == 200, ok


def test_wrong_key_401_unknown_model_404(served: FrontEnd) -> None:
    wrong = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    status, bare = request_json(f"{served.base_url}/v1/completions", {"prompt": "x"})
    assert status == 401 and bare["error"]["message"]
    right = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        right.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert http_status(f"{served.base_url}/metrics") == 200  # open to scrapers, as in vLLM


def test_tokenize_detokenize(served: FrontEnd, reference: LLM) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert request_json(f"{served.base_url}/tokenize", {"prompt": PROMPT})[0] == 401
    tokens = request_json(f"{served.base_url}/tokenize", {"prompt": PROMPT}, auth)[1]
    assert tokens["tokens"] == reference.get_tokenizer().encode(PROMPT)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = request_json(f"{served.base_url}/detokenize", {"tokens": tokens["tokens"]}, auth)[1]
    assert text["prompt"] == reference.get_tokenizer().decode(tokens["tokens"])
    assert request_json(f"{served.base_url}/detokenize", {"tokens": [10**9]}, auth)[0] == 400


def _wait_until_running(base_url: str) -> None:
    deadline = time.monotonic() + 10
    while total(scrape(base_url), "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline, "the request never showed as running"
        time.sleep(0.02)


def _wait_until_no_request_in_flight(base_url: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        samples = scrape(base_url)
        gauges = [k for k in samples if k.startswith("shoal:tenant_requests_in_flight{")]
        assert gauges, "the front end exports no in-flight gauge"
        if total(samples, "shoal:tenant_requests_in_flight") == 0:
            return
        assert time.monotonic() < deadline, "a request stayed in flight"
        time.sleep(0.05)


def _assert_freed_soon(base_url: str, within_s: float = 2.0) -> None:
    """No request running and no KV block in use within `within_s` of now."""
    since = time.monotonic()
    while True:
        samples = scrape(base_url)
        running = total(samples, "vllm:num_requests_running")
        usage = total(samples, "vllm:kv_cache_usage_perc")
        if running == 0 and usage == 0:
            return
        assert time.monotonic() - since < within_s, f"running {running}, KV usage {usage}"
        time.sleep(0.05)


def test_dropping_the_connection_mid_stream_frees_the_blocks(
    served: FrontEnd, client: openai.OpenAI
) -> None:
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=240, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    _wait_until_running(served.base_url)
    stream.close()
    _assert_freed_soon(served.base_url)


def test_dropping_the_connection_of_a_non_streamed_request_aborts_it(served: FrontEnd) -> None:
    # An earlier test's request still running would finish during this one, and count. The
    # ranks' stats may show it ended before the front end has counted its finish; the
    # front end's own in-flight gauge drops only after its handler (and the count) ended.
    _assert_freed_soon(served.base_url, within_s=60)
    _wait_until_no_request_in_flight(served.base_url)
    finished_before = total(scrape(served.base_url), "vllm:request_success_total")
    host, port = served.base_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}
    )
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    connection.request("POST", "/v1/completions", body=body, headers=headers)
    _wait_until_running(served.base_url)
    connection.close()  # before any response: the client is gone
    _assert_freed_soon(served.base_url)
    # Aborted, not finished: no finish of any reason was counted for it.
    assert total(scrape(served.base_url), "vllm:request_success_total") == finished_before


def _completions_totals(base_url: str) -> tuple[float, float, float]:
    samples = scrape(base_url)
    return (
        total(samples, "vllm:request_success_total"),
        total(samples, "vllm:prompt_tokens_total"),
        total(samples, "vllm:generation_tokens_total"),
    )


def _usage_sums(client: openai.OpenAI, num_requests: int) -> tuple[int, int]:
    prompt = generated = 0
    for i in range(num_requests):
        response = client.completions.create(
            model=MODEL_NAME, prompt=f"{PROMPT} {i}", max_tokens=3 + i % 4, temperature=0.0
        )
        assert response.usage is not None
        prompt += response.usage.prompt_tokens
        generated += response.usage.completion_tokens
    return prompt, generated


def test_metrics_parse_and_add_up_to_the_usage_returned(
    served: FrontEnd, client: openai.OpenAI
) -> None:
    before = _completions_totals(served.base_url)
    prompt, generated = _usage_sums(client, 6)
    after = _completions_totals(served.base_url)
    assert after[0] - before[0] == 6
    assert after[1] - before[1] == prompt
    assert after[2] - before[2] == generated
    samples = scrape(served.base_url)
    for name in (
        "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count", "vllm:inter_token_latency_seconds_count",
        "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
        "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
    ):  # fmt: skip
        assert total(samples, name, model_name=MODEL_NAME) > 0, name
    for rank in ("0", "1"):
        assert f"vllm:num_requests_waiting{{engine={rank},model_name={MODEL_NAME}}}" in samples
        assert f"vllm:prefix_cache_queries_total{{engine={rank},model_name={MODEL_NAME}}}" in (
            samples
        )
    assert total(samples, "vllm:num_preemptions_total") >= 0
    assert total(samples, "shoal:ranks", state="ready") == 2
    assert total(samples, "shoal:attached_clients") >= 1
    assert total(samples, "shoal:requests_routed_total") > 0


def test_a_user_or_session_header_keeps_requests_together_and_is_counted(
    served: FrontEnd, client: openai.OpenAI
) -> None:
    def sessions() -> float:
        samples = scrape(served.base_url)
        return total(samples, "shoal:routing_decisions_total", reason="session")

    before = sessions()
    for i in range(3):
        client.completions.create(
            model=MODEL_NAME, prompt=f"{PROMPT} {i}", max_tokens=2, user="alice"
        )
        client.completions.create(
            model=MODEL_NAME,
            prompt=f"{i} {PROMPT}",
            max_tokens=2,
            user="alice",
            extra_headers={"X-Session-ID": "conversation-7"},  # the header wins
        )
    assert sessions() - before == 4  # each session's first request is routed by cache and load
    with pytest.raises(openai.BadRequestError, match="at most 256 characters"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, user="u" * 300)


def test_attached_front_end_serves_the_same_cluster_and_counts_add_up(
    ray_head: RayHead,
    served: FrontEnd,
    client: openai.OpenAI,
    namespace: str,
    tmp_path: Path,
) -> None:
    args = [
        "api-server", "--namespace", namespace, "--host", "127.0.0.1", "--api-key", API_KEY,
        "--served-model-name", MODEL_NAME, "--data-parallel-address", "127.0.0.1",
    ]  # fmt: skip
    attached = start_shoal(ray_head, args, tmp_path / "api-server.log")
    try:
        other = openai.OpenAI(base_url=f"{attached.base_url}/v1", api_key=API_KEY, max_retries=0)
        # Each front end is its own scrape target: the sum over both is the cluster's total.
        before = [_completions_totals(f.base_url) for f in (served, attached)]
        usage_a = _usage_sums(client, 3)
        usage_b = _usage_sums(other, 4)
        after = [_completions_totals(f.base_url) for f in (served, attached)]
        assert after[0][0] - before[0][0] == 3 and after[1][0] - before[1][0] == 4
        assert sum(a[0] - b[0] for a, b in zip(after, before, strict=True)) == 7
        assert sum(a[1] - b[1] for a, b in zip(after, before, strict=True)) == (
            usage_a[0] + usage_b[0]
        )
        assert total(scrape(served.base_url), "shoal:attached_clients") >= 2

        # A stream on the serve front end runs on while the attached one is stopped mid-stream.
        texts: dict[str, str] = {}

        def consume(name: str, api: openai.OpenAI, max_tokens: int) -> None:
            chunks = api.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            try:
                texts[name] = "".join(c.choices[0].text for c in chunks if c.choices)
            except Exception:  # the connection is cut by the stop
                texts[name] = "<cut>"

        kept = threading.Thread(target=consume, args=("kept", client, 200))
        cut = threading.Thread(target=consume, args=("cut", other, 200))
        kept.start()
        cut.start()
        time.sleep(0.5)
        assert attached.stop() == 0, attached.output()
        kept.join(120)
        cut.join(30)
    finally:
        attached.stop()
    full = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=200, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert texts["kept"] == full.choices[0].text
    assert http_status(f"{served.base_url}/health") == 200
