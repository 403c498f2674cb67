"""A minimal reader of the GGUF container: metadata key/values, tensor infos, raw tensor bytes.

It parses the header with `struct` and maps the data section with numpy, so reading metadata
costs milliseconds even for a vocabulary of 50k strings. It knows nothing of model architectures
or tokenizers; `gguf_loader` and `shoal.engine.tokenizer` interpret what it returns.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from shoal.engine.errors import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF value type id -> struct format of one scalar (little-endian).
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY_DTYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING = 8
_ARRAY = 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry. `dims` is in GGML order: dims[0] is the contiguous axis."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def num_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        num_elements = int(np.prod(self.dims)) if self.dims else 1
        return num_elements // block_size * type_size


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: metadata, tensor infos, and where the tensor data starts."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data_offset: int

    def raw_tensor(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 rows: shape (*torch_shape[:-1], bytes per row).

        That is the layout `gguf.quants.dequantize` expects; the file is memory-mapped, not read.
        """
        info = self.tensors[name]
        data = np.memmap(
            self.path,
            dtype=np.uint8,
            mode="r",
            offset=self.data_offset + info.offset,
            shape=(info.num_bytes,),
        )
        rows = info.torch_shape[:-1]
        return data.reshape(*rows, info.num_bytes // max(1, int(np.prod(rows))))


class _Cursor:
    """Sequential little-endian reads over the file's bytes."""

    def __init__(self, buffer: np.ndarray, path: str) -> None:
        self.buffer: memoryview = buffer.data
        self.pos = 0
        self.path = path

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buffer):
            raise ModelLoadError(f"{self.path}: GGUF header is truncated at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise ModelLoadError(f"{self.path}: GGUF string runs past the end of the file")
        text = bytes(self.buffer[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        if value_type not in _SCALAR_FORMATS:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])

    def array(self) -> list[Any]:
        item_type = self.scalar("<I")
        count = self.scalar("<Q")
        if item_type in _NUMPY_DTYPES:
            dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder("<")
            end = self.pos + count * dtype.itemsize
            if end > len(self.buffer):
                raise ModelLoadError(f"{self.path}: GGUF array runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
            self.pos = end
            return values.tolist()
        return [self.value(item_type) for _ in range(count)]


def read_gguf(path: str) -> GGUFFile:
    """Parses a GGUF file's header (metadata and tensor infos), not its tensor data.

    Args:
        path: a .gguf file (version 2 or 3, little-endian).

    Returns:
        The parsed header.

    Raises:
        ModelLoadError: the file is missing, not GGUF, of an unsupported version, or truncated.
    """
    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    buffer = np.memmap(file, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer, path)
    if bytes(buffer[:4]) != _MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")
    cursor.pos = 4
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    num_tensors = cursor.scalar("<Q")
    num_kv = cursor.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    tensors: dict[str, GGUFTensorInfo] = {}
    for _ in range(num_tensors):
        name = cursor.string()
        num_dims = cursor.scalar("<I")
        dims = tuple(cursor.scalar("<Q") for _ in range(num_dims))
        ggml_type = cursor.scalar("<I")
        offset = cursor.scalar("<Q")
        tensors[name] = GGUFTensorInfo(name, dims, ggml_type, offset)
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_offset = -(-cursor.pos // alignment) * alignment
    _check_tensor_bounds(path, tensors, data_offset, len(buffer))
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, data_offset=data_offset)


def _check_tensor_bounds(
    path: str, tensors: dict[str, GGUFTensorInfo], data_offset: int, file_size: int
) -> None:
    for info in tensors.values():
        try:
            GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        except (ValueError, KeyError):
            raise ModelLoadError(
                f"{path}: tensor {info.name} has unknown GGML type {info.ggml_type}"
            ) from None
        end = data_offset + info.offset + info.num_bytes
        if end > file_size:
            raise ModelLoadError(
                f"{path}: tensor {info.name} ends at byte {end}, past the file's {file_size} "
                "bytes (truncated file?)"
            )
