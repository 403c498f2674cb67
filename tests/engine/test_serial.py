"""shoal.engine.serial: typed msgpack frames, out-of-band zero-copy arrays, tagged structs, no pickle."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    FinishReason,
    SamplingParams,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import INLINE_MAX_BYTES, MsgpackDecoder, MsgpackEncoder, tag_structs


def _roundtrip(value: Any, type_: Any = Any) -> Any:
    return MsgpackDecoder(type_).decode(MsgpackEncoder().encode(value))


def test_typed_structs_roundtrip_in_one_frame() -> None:
    request = EngineCoreRequest(
        "r1", [1, 2, 3], SamplingParams(max_tokens=7, stop=["x"]), client_index=2
    )
    frames = MsgpackEncoder().encode(request)
    assert len(frames) == 1
    assert MsgpackDecoder(EngineCoreRequest).decode(frames) == request
    outputs = EngineCoreOutputs(
        engine_index=1,
        outputs=[EngineCoreOutput("r1", [4, 5], finish_reason=FinishReason.LENGTH)],
        scheduler_stats=SchedulerStats(num_running_reqs=3),
    )
    assert _roundtrip(outputs, EngineCoreOutputs) == outputs


def test_large_tensor_travels_zero_copy_in_its_own_frame() -> None:
    tensor = torch.arange(1024, dtype=torch.float32)
    frames = MsgpackEncoder().encode({"t": tensor})
    assert len(frames) == 2
    buffer = frames[1]
    assert isinstance(buffer, memoryview)
    # The frame aliases the tensor's memory: no copy was made on the way out.
    assert np.frombuffer(buffer, dtype=np.uint8).ctypes.data == tensor.data_ptr()
    decoded = MsgpackDecoder().decode(frames)["t"]
    assert torch.equal(decoded, tensor)


def test_small_tensor_is_inlined() -> None:
    tensor = torch.ones(INLINE_MAX_BYTES // 4, dtype=torch.float32)
    frames = MsgpackEncoder().encode([tensor])
    assert len(frames) == 1
    assert torch.equal(MsgpackDecoder().decode(frames)[0], tensor)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 200).to(torch.bfloat16),
        torch.randn(50, 4, dtype=torch.float16),
        torch.tensor([True, False, True]),
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.arange(600, dtype=torch.int64).reshape(20, 30).t(),  # not contiguous
        torch.randn(100, dtype=torch.complex64),
    ],
    ids=["bf16", "f16", "bool", "0-d", "empty", "transposed", "complex"],
)
def test_tensor_dtypes_and_shapes_roundtrip(tensor: torch.Tensor) -> None:
    decoded = _roundtrip(tensor, torch.Tensor)
    assert decoded.dtype == tensor.dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_numpy_arrays_roundtrip() -> None:
    big = np.arange(2000, dtype=np.int32).reshape(40, 50)
    small = np.array([1.5, 2.5])
    frames = MsgpackEncoder().encode({"big": big, "small": small})
    assert len(frames) == 2
    decoded = MsgpackDecoder().decode(frames)
    np.testing.assert_array_equal(decoded["big"], big)
    np.testing.assert_array_equal(decoded["small"], small)
    assert decoded["big"].dtype == np.int32


def test_decoding_received_zmq_frames_aliases_them() -> None:
    ctx = zmq.Context()
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        sender.bind("inproc://serial-test")
        receiver.connect("inproc://serial-test")
        tensor = torch.randn(4096)
        sender.send_multipart(MsgpackEncoder().encode(tensor), copy=False)
        frames = receiver.recv_multipart(copy=False)
        decoded = MsgpackDecoder(torch.Tensor).decode(frames)
        assert torch.equal(decoded, tensor)
        frame_address = np.frombuffer(frames[1].buffer, dtype=np.uint8).ctypes.data
        assert decoded.data_ptr() == frame_address
    finally:
        ctx.destroy(linger=0)


def test_structs_in_any_fields_come_back_typed() -> None:
    stats = SchedulerStats(num_waiting_reqs=4, kv_cache_usage=0.5)
    facts = EngineFacts(0, b"id", "m", 128, 10, 16, 512)
    value = [stats, {"facts": facts}, 3, torch.arange(200)]
    output = UtilityOutput(7, result=UtilityResult(tag_structs(value)))
    decoded = _roundtrip(EngineCoreOutputs(utility_output=output), EngineCoreOutputs)
    assert decoded.utility_output is not None and decoded.utility_output.result is not None
    result = decoded.utility_output.result.result
    assert result[0] == stats and isinstance(result[0], SchedulerStats)
    assert result[1]["facts"] == facts
    assert result[2] == 3
    assert torch.equal(result[3], torch.arange(200))


def test_unregistered_struct_is_refused() -> None:
    class Private(msgspec.Struct):
        x: int

    with pytest.raises(TypeError, match="not registered"):
        MsgpackEncoder().encode(tag_structs(Private(1)))


def test_arbitrary_objects_are_never_pickled() -> None:
    with pytest.raises(TypeError, match="never pickled"):
        MsgpackEncoder().encode({"x": object()})
    with pytest.raises(TypeError, match="Python objects"):
        MsgpackEncoder().encode(np.array([object()]))


def _ext(code: int, payload: bytes) -> bytes:
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, payload))


@pytest.mark.parametrize(
    "frames, match",
    [
        ([_ext(1, msgspec.msgpack.encode(("pickle", [2], b"ab")))], "unknown tensor dtype"),
        ([_ext(1, msgspec.msgpack.encode(("float32", [4], 1)))], "frame 1 is missing"),
        ([_ext(2, msgspec.msgpack.encode(("|O", [1], b"\0" * 8)))], "Python objects"),
        ([_ext(3, b"os.system\0\x90")], "not a registered wire struct"),
        ([_ext(99, b"")], "unknown msgpack extension"),
    ],
    ids=["tensor-dtype", "missing-frame", "object-array", "unknown-struct", "unknown-ext"],
)
def test_hostile_frames_are_rejected(frames: list[bytes], match: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=match):
        MsgpackDecoder().decode(frames)


def test_decoder_validates_sampling_params() -> None:
    request = EngineCoreRequest("r", [1], SamplingParams())
    request.sampling_params.top_p = 0.0  # invalid, set after construction
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        _roundtrip(request, EngineCoreRequest)
