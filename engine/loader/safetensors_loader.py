"""Weights of a Hugging Face checkpoint directory: one model.safetensors or indexed shards.

Finds and validates the weight files, then streams `(name, tensor)` pairs under the names the
checkpoint stores, in its stored dtype — read whole, or (`iter_lazy_safetensors_weights`) as
`LazyTensor`s of which a consumer reads only the block it holds (a tensor-parallel shard) or
nothing; `SafetensorsReader` reads chosen tensors (or one row of one) by name instead. It does
not know which model consumes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.hf_config import read_json

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint directory, every one checked to exist.

    Args:
        model_dir: a Hugging Face checkpoint directory.

    Returns:
        (files, weight_map): the files in load order, and the index's name -> file map for a
        sharded checkpoint (None for a single file).

    Raises:
        ModelLoadError: no weights, a malformed index, or a shard the index names is missing.
    """
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: has no 'weight_map' entries")
        shard_names = sorted(set(weight_map.values()))
        missing = [name for name in shard_names if not (model_dir / name).is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_path}: shard(s) {', '.join(missing)} listed in the index are missing "
                f"from {model_dir}"
            )
        return [model_dir / name for name in shard_names], weight_map
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single], None
    raise ModelLoadError(
        f"{model_dir}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE}; "
        ".bin / .pt checkpoints are not supported)"
    )


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Streams every tensor of the checkpoint, shard by shard.

    Raises:
        ModelLoadError: a file is corrupt or truncated, or a shard lacks a tensor its index names.
    """
    files, weight_map = weight_files(model_dir)
    for file in files:
        expected = None
        if weight_map is not None:
            expected = {name for name, shard in weight_map.items() if shard == file.name}
        yield from _iter_file(file, expected)


def iter_lazy_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, LazyTensor]]:
    """Every tensor of the checkpoint as a `LazyTensor`, valid until the iteration moves on.

    Raises:
        ModelLoadError: as `iter_safetensors_weights`.
    """
    files, weight_map = weight_files(model_dir)
    for file in files:
        expected = None
        if weight_map is not None:
            expected = {name for name, shard in weight_map.items() if shard == file.name}
        yield from _iter_file(file, expected, lazy=True)


class LazyTensor:
    """One stored tensor, unread: its shape, then a read of all of it or of one block.

    Args:
        name: the tensor's name, for errors.
        file: the file it is in, for errors.
        view: the safetensors slice handle (valid while its file is open).
    """

    def __init__(self, name: str, file: Path, view: Any) -> None:
        self.name, self.file, self._view = name, file, view
        self.shape = tuple(view.get_shape())

    def read(self) -> torch.Tensor:
        return self.read_block(0, 0, self.shape[0]) if self.shape else self._view[:]

    def read_block(self, dim: int, start: int, size: int) -> torch.Tensor:
        """Rows `[start, start + size)` of dimension `dim` only (the rest stays on disk)."""
        index = tuple([slice(None)] * dim + [slice(start, start + size)])
        try:
            return self._view[index]
        except SafetensorError as exc:
            raise ModelLoadError(f"{self.file}: cannot read {self.name} ({exc})") from exc


def _iter_file(
    file: Path, expected: set[str] | None, *, lazy: bool = False
) -> Iterator[tuple[str, Any]]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            names = list(handle.keys())
            if expected is not None and not expected <= set(names):
                absent = sorted(expected - set(names))
                raise ModelLoadError(
                    f"{file}: the index places {', '.join(absent[:5])} here, but the file "
                    "does not hold them"
                )
            for name in names:
                if lazy:
                    yield name, LazyTensor(name, file, handle.get_slice(name))
                else:
                    yield name, handle.get_tensor(name)
    except SafetensorError as exc:
        raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({exc})") from exc
    except OSError as exc:
        raise ModelLoadError(f"{file}: cannot read ({exc})") from exc


class SafetensorsReader:
    """Reads chosen tensors of a safetensors checkpoint by name, leaving the others on disk.

    The names come from the index (a sharded checkpoint) or the file's header; a shard is opened
    when a tensor in it is first read, and stays open until `close` (or the end of a `with`).

    Args:
        path: a checkpoint directory (model.safetensors or indexed shards) or one
            .safetensors file.

    Raises:
        ModelLoadError: no weights, a malformed index, a missing or unreadable file.
    """

    def __init__(self, path: str | Path) -> None:
        location = Path(path)
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        if location.is_dir():
            files, weight_map = weight_files(location)
        elif location.is_file():
            files, weight_map = [location], None
        else:
            raise ModelLoadError(f"{path}: no such file or directory")
        if weight_map is None:
            self._file_of = dict.fromkeys(self._open(files[0]).keys(), files[0])
        else:
            self._file_of = {name: location / shard for name, shard in weight_map.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor `name`, or with `index` only its row `tensor[index]` (the rest unread).

        Raises:
            ModelLoadError: no such tensor, an index past its first dimension, a corrupt file.
        """
        file = self._file_of.get(name)
        if file is None:
            raise ModelLoadError(f"the checkpoint has no tensor {name!r}")
        handle = self._open(file)
        try:
            if index is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[index]
        except IndexError as exc:
            raise ModelLoadError(f"{file}: {name}[{index}] is out of range ({exc})") from exc
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: cannot read {name} ({exc})") from exc

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _open(self, file: Path) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            except SafetensorError as exc:
                raise ModelLoadError(
                    f"{file}: corrupt or truncated safetensors file ({exc})"
                ) from exc
            except OSError as exc:
                raise ModelLoadError(f"{file}: cannot read ({exc})") from exc
            self._handles[file] = handle
        return handle
