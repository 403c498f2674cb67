"""Where a request id is made unique across clients: once, in the rank, as it comes and goes.

A client names its requests as it likes; two clients may pick the same id, and no client can
be trusted to pick ids that stay clear of another's. So the rank scopes each id by the index of
the connection it came on, never by anything the sender says: an ADD's and an ABORT's ids
become `"<client_index>/<id>"` as the busy loop takes them in, everything inside the engine
(scheduler, KV cache, model runner) sees only scoped ids, and the outputs, and the ids a
leaving rank releases, get the client's own id back as they leave for that client. A client
never rewrites an id, and no id is rewritten anywhere else.
"""

from __future__ import annotations

from collections.abc import Iterable

from shoal.engine.protocol import EngineCoreOutput


def scoped(client_index: int, request_id: str) -> str:
    """The engine's id of a client's request (an empty id stays empty: it is refused)."""
    return f"{client_index}/{request_id}" if request_id else request_id


def scoped_all(client_index: int, request_ids: Iterable[str]) -> list[str]:
    return [f"{client_index}/{r}" for r in request_ids]


def unscoped(client_index: int, engine_request_id: str) -> str:
    """The client's own id of one of its requests."""
    return engine_request_id[len(str(client_index)) + 1 :]


def unscope_outputs(client_index: int, outputs: Iterable[EngineCoreOutput]) -> None:
    """Gives each output of a client's requests the client's own id back, in place."""
    scope = len(str(client_index)) + 1
    for output in outputs:
        if output.request_id:
            output.request_id = output.request_id[scope:]
