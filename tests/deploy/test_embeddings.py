"""`/v1/embeddings` through the official `openai` client: a pooling engine's vectors (a string,
a list of strings, token ids; base64, the client's default, or floats) equal transformers'
pooled states; a generating model and bad inputs are 400s."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest
import torch
import transformers

from shoal.deploy.openai.limits import FrontEndLimits
from shoal.engine.tokenizer import load_tokenizer
from tests.deploy.inproc_server import MODEL_NAME, serving_in_process
from tests.deploy.openai_utils import scrape, total
from tests.factories import make_tiny_checkpoint
from tests.tolerances import assert_reordered_close, decoder_reduction_length

TEXTS = ["Paris is the capital of France.", "Embeddings", "A third, longer input for the batch."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def client(checkpoint: str) -> Iterator[openai.OpenAI]:
    """A MEAN-pooling engine behind the real front end."""
    pooler = {"pooling_type": "MEAN"}
    with serving_in_process(checkpoint, runner="pooling", pooler_config=pooler) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _expected(checkpoint: str, token_ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]
    mean = states.mean(dim=0)
    return mean / mean.norm()


def _length(num_tokens: int) -> int:
    config = {"hidden": 64, "intermediate": 128, "head_dim": 16, "num_layers": 2}
    return decoder_reduction_length(**config, context=num_tokens) + num_tokens


@pytest.mark.slow
def test_a_string_and_a_list_of_strings_embed_as_transformers_pools(
    client: openai.OpenAI, checkpoint: str
) -> None:
    tokenizer = load_tokenizer(checkpoint)
    one = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])  # base64 on the wire
    assert len(one.data) == 1 and one.data[0].index == 0
    token_ids = tokenizer.encode(TEXTS[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(token_ids)
    expected = _expected(checkpoint, token_ids)
    assert_reordered_close(
        torch.tensor(one.data[0].embedding), expected, length=_length(len(token_ids)), scale=1.0
    )
    many = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for text, item in zip(TEXTS, many.data, strict=True):
        ids = tokenizer.encode(text)
        vector = torch.tensor(item.embedding)
        assert math.isclose(float(vector.norm()), 1.0, rel_tol=1e-5)
        assert_reordered_close(
            vector, _expected(checkpoint, ids), length=_length(len(ids)), scale=1.0
        )
    assert many.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    by_ids = client.embeddings.create(model=MODEL_NAME, input=[token_ids], encoding_format="float")
    assert_reordered_close(
        torch.tensor(by_ids.data[0].embedding), expected, length=_length(len(token_ids)), scale=1.0
    )
    # Each input is a served request in /metrics (its prompt tokens, no generated ones).
    samples = scrape(str(client.base_url).removesuffix("/v1/"))
    assert total(samples, "vllm:request_success_total", finished_reason="stop") >= 5
    assert total(samples, "vllm:prompt_tokens_total") >= 2 * len(token_ids)
    assert total(samples, "vllm:generation_tokens_total") == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"input": "hi", "dimensions": 8}, "dimensions is not supported"),
        ({"input": []}, "input must not be empty"),
        ({"input": ["ok", ""]}, "empty item"),
        ({"input": [list(range(1, 600))]}, "maximum context length"),
    ],
)
def test_bad_inputs_are_400s(
    client: openai.OpenAI, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.embeddings.create(model=MODEL_NAME, **fields)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_model_served_for_generation_names_how_to_serve_embeddings(
    inproc_client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="--runner pooling") as info:
        inproc_client.embeddings.create(model=MODEL_NAME, input="hi")
    assert info.value.status_code == 400


@pytest.mark.slow
def test_a_batch_past_the_sequence_cap_is_a_400_naming_the_flag(checkpoint: str) -> None:
    limits = FrontEndLimits(max_sequences_per_request=2)
    with serving_in_process(checkpoint, runner="pooling", limits=limits) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--max-sequences-per-request"):
            client.embeddings.create(model=MODEL_NAME, input=TEXTS)
        assert len(client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2]).data) == 2
