"""The grammar sandbox's child process: compiles constraints it is sent, one at a time.

Run as `python -m shoal.deploy.openai.grammar_check` by `grammar_sandbox.GrammarSandbox`,
never by hand. Protocol, on its stdin and stdout (each message a 4-byte big-endian length and
a msgpack body):

    parent → child: CheckRequest(params)     the constraint to compile
    child → parent: CheckResult(error)       None: it compiles; else the compiler's message

Each check builds llguidance's grammar and validates it (the compile the engine does, less
the tokenizer's lexer tables) on a thread whose stack is `SANDBOX_STACK_BYTES`; the process's
address space is capped at `SANDBOX_MEMORY_BYTES`, it never writes a core file, and it runs
at a lower CPU priority (nice +5). A
constraint that overflows that stack or that memory kills this process and nothing else: the
parent answers that request with a 400 and starts another child. This module imports no
front-end code.
"""

from __future__ import annotations

import contextlib
import os
import resource
import struct
import sys
from typing import BinaryIO

import msgspec

from shoal.engine.errors import RequestError
from shoal.engine.protocol import StructuredOutputsParams
from shoal.engine.structured_output import COMPILE_STACK_BYTES, DeepStackThread, grammar_text

# The engine compiles on a stack eight times this one: whatever compiles here compiles there.
SANDBOX_STACK_BYTES = COMPILE_STACK_BYTES // 8
# The child's address space (virtual memory, thread stacks included), at most.
SANDBOX_MEMORY_BYTES = 2 << 30
_HEADER = struct.Struct(">I")
_NICENESS = 5  # as the tokenizer pool's threads


class CheckRequest(msgspec.Struct, array_like=True):
    """A constraint to compile."""

    params: StructuredOutputsParams


class CheckResult(msgspec.Struct, array_like=True):
    """Whether it compiled: `error` is None, or the compiler's message."""

    error: str | None = None


def check(params: StructuredOutputsParams) -> str | None:
    """Compiles `params` without a tokenizer; the compiler's message if it does not."""
    import llguidance

    try:
        text = grammar_text(params)
    except (RequestError, ValueError) as e:
        return str(e)
    message = llguidance.LLMatcher.validate_grammar(text)
    return f"structured_outputs does not compile: {message}" if message else None


def read_message(stream: BinaryIO) -> bytes | None:
    """One framed message; None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    body = stream.read(_HEADER.unpack(header)[0])
    return body if len(body) == _HEADER.unpack(header)[0] else None


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


def _limit_resources() -> None:
    with contextlib.suppress(OSError):  # on a busy machine the front end and engines come first
        os.nice(_NICENESS)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = (
        SANDBOX_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, SANDBOX_MEMORY_BYTES)
    )
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def main() -> None:
    _limit_resources()
    decoder = msgspec.msgpack.Decoder(CheckRequest)
    encoder = msgspec.msgpack.Encoder()
    worker = DeepStackThread("shoal-grammar-check", SANDBOX_STACK_BYTES)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (body := read_message(stdin)) is not None:
        try:
            error = worker.run(check, decoder.decode(body).params)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
            error = f"structured_outputs is malformed: {e}"
        except MemoryError:
            error = "structured_outputs needs more memory to compile than this server allows"
        stdout.write(frame(encoder.encode(CheckResult(error))))
        stdout.flush()


if __name__ == "__main__":
    main()
