"""msgpack encoding of wire structs with out-of-band tensor frames; never pickle.

A message is a list of frames `[main, *buffers]`. Tensors and numpy arrays become msgpack Ext
values holding (dtype, shape, data), where data is either the raw bytes (small arrays) or the
index of a later frame carrying them zero-copy. torch is imported only when a tensor is sent
or received, so a client that never sees one never loads it. msgspec Structs inside `Any` fields (utility
results) travel tagged with their name so the peer decodes them typed; only registered struct
types can be named. This module knows nothing of sockets or of who sends what.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from shoal.engine import protocol

if TYPE_CHECKING:
    import torch

# Arrays of at most this many bytes are inlined in the main frame: a separate ZMQ frame
# costs more than copying a few hundred bytes.
INLINE_MAX_BYTES = 256

_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_STRUCT = 3


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """The tensor dtypes the wire carries, by name."""
    import torch

    dtypes = (
        *(torch.float64, torch.float32, torch.float16, torch.bfloat16),
        *(torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool),
        *(torch.complex64, torch.complex128),
    )
    return {str(d).removeprefix("torch."): d for d in dtypes}


# Struct types a peer may name in a tagged value. Only these are ever instantiated from the
# wire; every struct of the protocol module is registered.
_WIRE_STRUCTS: dict[str, type[msgspec.Struct]] = {}

Frame = bytes | bytearray | memoryview | zmq.Frame


def register_wire_struct(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """Allows `cls` to be sent tagged inside `Any` fields (e.g. as a utility result).

    Returns:
        `cls`, so this can decorate a class.
    """
    _WIRE_STRUCTS[cls.__name__] = cls
    return cls


for _value in list(vars(protocol).values()):
    if isinstance(_value, type) and issubclass(_value, msgspec.Struct):
        register_wire_struct(_value)


class TaggedStruct:
    """Marks a struct to be sent with its type name, for fields typed `Any`."""

    __slots__ = ("value",)

    def __init__(self, value: msgspec.Struct) -> None:
        self.value = value


def tag_structs(value: Any) -> Any:
    """Wraps registered structs in `value` (and in its lists, tuples, dict values) for typed decode.

    Use on values of `Any`-typed fields, such as utility results, that may hold structs.
    """
    if isinstance(value, msgspec.Struct):
        return TaggedStruct(value)
    if isinstance(value, (list, tuple)):
        return [tag_structs(v) for v in value]
    if isinstance(value, dict):
        return {k: tag_structs(v) for k, v in value.items()}
    return value


class MsgpackEncoder:
    """Encodes an object into frames `[main, *buffers]`. Not thread-safe: one per thread.

    Args:
        inline_max_bytes: arrays up to this size are copied into the main frame.
    """

    def __init__(self, inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        # A second encoder for payloads nested in Ext values: the outer one is mid-call.
        self._nested = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._inline_max_bytes = inline_max_bytes
        self._buffers: list[bytes | memoryview] | None = None

    def encode(self, obj: Any) -> list[bytes | memoryview]:
        """Returns the frames; buffers alias the arrays' memory, keep those alive until sent.

        Raises:
            TypeError: for a value msgpack cannot carry (an arbitrary object, an object array).
        """
        frames: list[bytes | memoryview] = [b""]
        self._buffers = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._buffers = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # not loaded: obj cannot be a tensor
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj)
        if isinstance(obj, TaggedStruct):
            name = type(obj.value).__name__
            if _WIRE_STRUCTS.get(name) is not type(obj.value):
                raise TypeError(f"struct {name} is not registered as a wire struct")
            data = name.encode() + b"\0" + self._nested.encode(obj.value)
            return msgspec.msgpack.Ext(_EXT_STRUCT, data)
        raise TypeError(f"cannot send a {type(obj).__name__} over the wire (never pickled)")

    def _encode_tensor(self, tensor: torch.Tensor) -> msgspec.msgpack.Ext:
        import torch

        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _torch_dtypes() or tensor.layout is not torch.strided:
            raise TypeError(f"cannot send a tensor of dtype {tensor.dtype}, layout {tensor.layout}")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        data = self._place(flat.view(torch.uint8).numpy() if flat.numel() else None)
        return msgspec.msgpack.Ext(_EXT_TENSOR, self._nested.encode((dtype, tensor.shape, data)))

    def _encode_ndarray(self, array: np.ndarray) -> msgspec.msgpack.Ext:
        if array.dtype.hasobject:
            raise TypeError("cannot send a numpy array of Python objects")
        flat = np.ascontiguousarray(array).reshape(-1)
        data = self._place(flat.view(np.uint8) if flat.size else None)
        return msgspec.msgpack.Ext(
            _EXT_NDARRAY, self._nested.encode((flat.dtype.str, array.shape, data))
        )

    def _place(self, raw: np.ndarray | None) -> bytes | int:
        """Inline bytes, or the frame index of a zero-copy buffer."""
        if raw is None:
            return b""
        if raw.nbytes <= self._inline_max_bytes:
            return raw.tobytes()
        assert self._buffers is not None, "arrays are only encoded inside encode()"
        self._buffers.append(raw.data)
        return len(self._buffers) - 1


_ArrayHeader = tuple[str, tuple[int, ...], int | bytes]


class MsgpackDecoder:
    """Decodes frames made by `MsgpackEncoder` into `type_` (or plain msgpack values if None).

    Create one per message type and thread, once: the typed msgspec decoder is built here.
    Arrays carried in frames received with `copy=False` alias those frames (zero-copy).
    """

    def __init__(self, type_: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        self._header_decoder = msgspec.msgpack.Decoder(_ArrayHeader)
        self._struct_decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}
        self._buffers: Sequence[Frame] = ()

    def decode(self, frames: Frame | Sequence[Frame]) -> Any:
        """Decodes one message.

        Raises:
            msgspec.DecodeError: malformed msgpack (msgspec.ValidationError: wrong shape/type).
        """
        if type(frames) is list and len(frames) == 1:  # the hot path: one received message
            return self._decoder.decode(_as_buffer(frames[0]))
        if not isinstance(frames, Sequence) or isinstance(frames, (bytes, bytearray, memoryview)):
            return self._decoder.decode(_as_buffer(frames))
        if len(frames) == 1:
            return self._decoder.decode(_as_buffer(frames[0]))
        self._buffers = frames
        try:
            return self._decoder.decode(_as_buffer(frames[0]))
        finally:
            self._buffers = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_TENSOR:
            dtype_name, shape, raw = self._header_decoder.decode(data)
            import torch

            dtype = _torch_dtypes().get(dtype_name)
            if dtype is None:
                raise msgspec.ValidationError(f"unknown tensor dtype {dtype_name!r}")
            buffer = self._array_bytes(raw)
            _check_array_size(shape, dtype.itemsize, len(buffer))
            if len(buffer) == 0:  # a shape with no elements: nothing is left uninitialized
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
        if code == _EXT_NDARRAY:
            dtype_str, shape, raw = self._header_decoder.decode(data)
            try:
                np_dtype = np.dtype(dtype_str)
            except TypeError as e:
                raise msgspec.ValidationError(f"unknown array dtype {dtype_str!r}") from e
            if np_dtype.hasobject:
                raise msgspec.ValidationError("numpy arrays of Python objects are refused")
            buffer = self._array_bytes(raw)
            _check_array_size(shape, np_dtype.itemsize, len(buffer))
            return np.frombuffer(buffer, dtype=np_dtype).reshape(shape)
        if code == _EXT_STRUCT:
            name, _, payload = bytes(data).partition(b"\0")
            return self._struct_decoder(name.decode()).decode(payload)
        raise msgspec.ValidationError(f"unknown msgpack extension code {code}")

    def _array_bytes(self, raw: int | bytes) -> memoryview | bytearray:
        if isinstance(raw, bytes):
            return bytearray(raw)  # torch wants a writable buffer
        if not 0 < raw < len(self._buffers):
            raise msgspec.ValidationError(f"array frame {raw} is missing")
        frame = self._buffers[raw]
        if isinstance(frame, zmq.Frame):
            return frame.buffer  # writable: the tensor aliases the received frame
        if (isinstance(frame, memoryview) and not frame.readonly) or isinstance(frame, bytearray):
            return frame
        return bytearray(frame)

    def _struct_decoder(self, name: str) -> msgspec.msgpack.Decoder[Any]:
        decoder = self._struct_decoders.get(name)
        if decoder is None:
            cls = _WIRE_STRUCTS.get(name)
            if cls is None:
                raise msgspec.ValidationError(f"{name!r} is not a registered wire struct")
            decoder = msgspec.msgpack.Decoder(cls, ext_hook=self._ext_hook, dec_hook=_dec_hook)
            self._struct_decoders[name] = decoder
        return decoder


def _check_array_size(shape: tuple[int, ...], itemsize: int, num_bytes: int) -> None:
    """Refuses an array whose shape does not match its bytes exactly: a peer's header must
    never make the decoder allocate (or hand back) memory the peer did not send."""
    num_elements = 1
    for dim in shape:
        if dim < 0:
            raise msgspec.ValidationError(f"negative array dimension in shape {shape}")
        num_elements *= dim
    if num_elements * itemsize != num_bytes:
        raise msgspec.ValidationError(
            f"an array of shape {tuple(shape)} needs {num_elements * itemsize} bytes, "
            f"{num_bytes} were sent"
        )


def _as_buffer(frame: Frame) -> bytes | bytearray | memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else frame


def _dec_hook(type_: type, obj: Any) -> Any:
    # Ext values were already turned into arrays by the ext hook; this only checks the type.
    if isinstance(obj, type_):
        return obj
    raise msgspec.ValidationError(f"expected {type_.__name__}, got {type(obj).__name__}")


# --- reading ids out of frames that do not decode (to answer the sender with an error) ------


def peek_request_id(buffer: memoryview | bytes) -> str | None:
    """The first element of a msgpack array if it is a string (an ADD's request id), else None.

    Works on truncated frames: only the array header and that string must be intact.
    """
    data = bytes(buffer[:4096])
    position = _skip_array_header(data)
    if position is None or position >= len(data):
        return None
    tag = data[position]
    if 0xA0 <= tag <= 0xBF:
        length, position = tag & 0x1F, position + 1
    elif tag in _STR_LENGTH_BYTES:
        size = _STR_LENGTH_BYTES[tag]
        length = int.from_bytes(data[position + 1 : position + 1 + size], "big")
        position += 1 + size
    else:
        return None
    raw = data[position : position + length]
    if len(raw) != length:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def peek_call_id(buffer: memoryview | bytes) -> int | None:
    """The second element of a msgpack array if it is an integer (a UTILITY's call id)."""
    data = bytes(buffer[:64])
    position = _skip_array_header(data)
    if position is None:
        return None
    first = _read_int(data, position)
    if first is None:
        return None
    second = _read_int(data, first[1])
    return None if second is None else second[0]


_STR_LENGTH_BYTES = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_INT_FORMATS = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False)}
_INT_FORMATS |= {0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}


def _skip_array_header(data: bytes) -> int | None:
    if not data:
        return None
    if 0x90 <= data[0] <= 0x9F:
        return 1
    return {0xDC: 3, 0xDD: 5}.get(data[0])


def _read_int(data: bytes, position: int) -> tuple[int, int] | None:
    if position >= len(data):
        return None
    tag = data[position]
    if tag <= 0x7F:
        return tag, position + 1
    if tag >= 0xE0:
        return tag - 0x100, position + 1
    if tag not in _INT_FORMATS:
        return None
    size, signed = _INT_FORMATS[tag]
    raw = data[position + 1 : position + 1 + size]
    if len(raw) != size:
        return None
    return int.from_bytes(raw, "big", signed=signed), position + 1 + size
