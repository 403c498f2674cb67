"""Exceptions that cross layer boundaries, and whether the caller can recover from each."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """An engine core died; requests pending on it are lost. Not recoverable on that engine.

    Args:
        message: what happened, if known.
        engine_index: the dead engine's rank, or None when it is unknown or all are dead.
    """

    def __init__(self, message: str = "", *, engine_index: int | None = None) -> None:
        self.engine_index = engine_index
        where = f" (engine {engine_index})" if engine_index is not None else ""
        detail = f": {message}" if message else ""
        super().__init__(f"Engine core died{where}{detail}. See the engine's logs for the cause.")


class RequestError(ValueError):
    """One request was rejected or failed; the engine and all other requests are unaffected."""


class ModelLoadError(RuntimeError):
    """A checkpoint could not be loaded; the message names the file and what is wrong."""
