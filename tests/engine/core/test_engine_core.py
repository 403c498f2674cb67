"""`EngineCore` in-process: outputs per client, validation, ownership, utilities, counters."""

from __future__ import annotations

import logging

import pytest
import torch

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import MAX_REQUEST_ID_CHARS, EngineCore
from shoal.engine.protocol import EngineCoreOutputs, EngineCoreRequest, FinishReason, SamplingParams
from tests.factories import make_tiny_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    return EngineCore(EngineConfig.from_kwargs(path, max_model_len=128), engine_index=3)


def _request(request_id: str, client_index: int = 0, **kw: object) -> EngineCoreRequest:
    fields: dict[str, object] = {"prompt_token_ids": [4, 5, 6], "sampling_params": PARAMS}
    fields.update(kw)
    return EngineCoreRequest(request_id, client_index=client_index, **fields)  # type: ignore[arg-type]


def _run(core: EngineCore) -> dict[int, list[EngineCoreOutputs]]:
    per_client: dict[int, list[EngineCoreOutputs]] = {}
    while core.has_unfinished_requests():
        for client_index, outputs in core.step().items():
            per_client.setdefault(client_index, []).append(outputs)
    return per_client


def test_outputs_are_grouped_by_client_and_stamped(core: EngineCore) -> None:
    core.add_request(_request("a", client_index=0))
    core.add_request(_request("b", client_index=7))
    per_client = _run(core)
    assert {o.request_id for f in per_client[0] for o in f.outputs} == {"a"}
    assert {o.request_id for f in per_client[7] for o in f.outputs} == {"b"}
    frames = [f for frames in per_client.values() for f in frames]
    assert all(f.engine_index == 3 and f.scheduler_stats is not None for f in frames)


def test_invalid_requests_become_error_outputs_for_their_client(core: EngineCore) -> None:
    core.add_request(_request("too-long", client_index=2, prompt_token_ids=list(range(1, 200))))
    core.add_request(_request("", client_index=2))
    core.add_request(_request("ok", client_index=2))
    core.add_request(_request("ok", client_index=2))  # duplicate of a live id: dropped
    outputs = [o for f in _run(core)[2] for o in f.outputs]
    errors = {
        o.request_id: o.error_message for o in outputs if o.finish_reason == FinishReason.ERROR
    }
    assert "maximum context length is 128" in (errors["too-long"] or "")
    assert "must not be empty" in (errors[""] or "")
    assert "ok" not in errors  # the live request finishes once, and not with an error
    finished_ok = [
        o for o in outputs if o.request_id == "ok" and o.finish_reason == FinishReason.LENGTH
    ]
    assert len(finished_ok) == 1


def test_a_request_id_past_the_bound_is_refused_and_logged_cut_short(
    core: EngineCore, caplog: pytest.LogCaptureFixture
) -> None:
    huge = "x" * 1_000_000
    with caplog.at_level(logging.INFO, logger="shoal.engine.core.request_intake"):
        core.add_request(_request(huge, client_index=2, prompt_token_ids=[]))
        core.add_request(_request("y" * MAX_REQUEST_ID_CHARS, client_index=2))
    outputs = {o.request_id: o for f in _run(core)[2] for o in f.outputs if o.finished}
    assert f"longer than {MAX_REQUEST_ID_CHARS}" in (outputs[huge].error_message or "")
    assert outputs["y" * MAX_REQUEST_ID_CHARS].finish_reason == FinishReason.LENGTH
    assert len(caplog.text) < 1000 and "(1000000 chars)" in caplog.text


def test_abort_is_limited_to_the_owning_client(core: EngineCore) -> None:
    core.add_request(
        _request("owned", client_index=1, sampling_params=SamplingParams(max_tokens=50))
    )
    core.step()
    core.abort_requests(["owned"], client_index=4)
    assert core.scheduler.get_request("owned") is not None
    core.abort_requests(["owned"], client_index=1)
    assert core.scheduler.get_request("owned") is None
    _run(core)


def test_requests_seen_counts_each_clients_adds_and_resets_on_detach(core: EngineCore) -> None:
    before = core.requests_seen.get(5, 0)
    for i in range(3):
        core.add_request(_request(f"seen-{i}", client_index=5))
    frames = _run(core)[5]
    assert frames[0].requests_seen == before + 3
    assert core.abort_client_requests(5) == []
    assert 5 not in core.requests_seen


def test_collective_rpc_reaches_only_public_runner_methods(core: EngineCore) -> None:
    with pytest.raises(AttributeError, match="no public method"):
        core.collective_rpc("_private")
    with pytest.raises(AttributeError, match="no public method"):
        core.collective_rpc("does_not_exist")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_the_device_setting_is_honoured(engine_checkpoint: str) -> None:
    cpu = EngineCore(EngineConfig.from_kwargs(engine_checkpoint, device="cpu"))
    assert cpu.executor.device.type == "cpu"
    with pytest.raises(ValueError, match=r"'cuda' was asked for.*sees no CUDA device"):
        EngineCore(EngineConfig.from_kwargs(engine_checkpoint, device="cuda"))
