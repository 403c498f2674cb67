"""A cluster launched from a Hub id (the local mirror in `tests.hub_mirror`) as a pooling
engine: each rank downloads the id on its node, a driver attached by namespace reads the
tokenizer from its own copy, and `AsyncLLM.encode` and the front end's `/v1/embeddings` (the
official `openai` client) return what `LLM.embed` does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from shoal.client.api.async_llm import AsyncLLM
from shoal.client.api.llm import LLM
from shoal.cluster.launch import LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.deploy.openai.server import FrontEndConfig, FrontEndThread
from shoal.deploy.preflight import bind_http_port
from shoal.engine.config import EngineConfig
from shoal.engine.loader.hub import _download
from tests.factories import make_tiny_checkpoint
from tests.hub_mirror import HubMirror, serving_hub
from tests.ray_utils import free_port, local_ray, unique_namespace
from tests.tolerances import assert_reordered_close, decoder_reduction_length

pytestmark = pytest.mark.slow

REPO = "shoal-test/tiny-embed"
TEXTS = ["a cluster of embeddings", "another input"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubMirror, Path]]:
    """The mirror, with `HF_ENDPOINT` set before Ray starts (its workers inherit it)."""
    folder = Path(make_tiny_checkpoint(tmp_path_factory.mktemp("embed-model")))
    mirror = HubMirror({})
    mirror.add(REPO, "main", folder)
    with serving_hub(mirror), pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ENDPOINT", mirror.url)
        _download.cache_clear()
        yield mirror, tmp_path_factory.mktemp("downloads")


def test_ranks_download_the_id_and_pool_as_the_local_engine(
    hub: tuple[HubMirror, Path],
) -> None:
    mirror, downloads = hub
    kwargs: dict[str, Any] = {
        "runner": "pooling",
        "pooler_config": {"pooling_type": "MEAN"},
        "num_gpu_blocks_override": 64,
        "max_model_len": 256,
        "download_dir": str(downloads),
    }
    with local_ray(num_cpus=2):
        config = EngineConfig.from_kwargs(REPO, **kwargs)
        options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1", ready_timeout_s=180)
        handle = launch(config, options, namespace=unique_namespace("hub"))
        try:
            assert handle.membership().config.model.model == REPO  # each node resolves it
            served = asyncio.run(_encode_all(handle.namespace))
            over_http = _embed_over_http(handle.namespace)
        finally:
            handle.shutdown()
    assert any(method == "GET" and "/resolve/" in path for method, path in mirror.requests)
    local = LLM(REPO, **kwargs)
    try:
        expected = [torch.tensor(o.outputs.embedding) for o in local.embed(TEXTS, use_tqdm=False)]
    finally:
        local.shutdown()
    length = decoder_reduction_length(
        hidden=64, intermediate=128, head_dim=16, num_layers=2, context=16
    )
    for ours, http, theirs in zip(served, over_http, expected, strict=True):
        assert_reordered_close(ours, theirs, length=length + 16, scale=1.0)
        assert_reordered_close(http, theirs, length=length + 16, scale=1.0)


async def _encode_all(namespace: str) -> list[torch.Tensor]:
    llm = await AsyncLLM.connect(namespace)
    try:
        vectors = []
        for text in TEXTS:
            async for output in llm.encode(text):
                assert output.error is None
                vectors.append(torch.tensor(output.outputs.embedding))
        return vectors
    finally:
        await llm.aclose()


def _embed_over_http(namespace: str) -> list[torch.Tensor]:
    """The vectors of `TEXTS` from a front end attached to the cluster, as `shoal serve --port`
    runs one, through the official client (base64 on the wire)."""
    port = free_port()
    sock = bind_http_port("127.0.0.1", port)
    sock.listen()  # a request made before the front end serves waits in the backlog
    front_end = FrontEndThread(FrontEndConfig(namespace, host="127.0.0.1", port=port), sock)
    front_end.start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        one = client.embeddings.create(model=REPO, input=TEXTS[0])
        both = client.embeddings.create(model=REPO, input=TEXTS)
    finally:
        front_end.stop()
        sock.close()
    assert len(one.data) == 1 and len(both.data) == len(TEXTS)
    return [torch.tensor(item.embedding) for item in both.data]
