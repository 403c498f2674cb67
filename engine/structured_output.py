"""Grammars for structured outputs: compile a request's constraint, track it, mask its logits.

The engine owns one `GrammarCompiler` (built on the first constrained request: it reads the
model's tokenizer once) and gives each constrained `Request` a `RequestGrammar`. Per step:

1. Before the forward pass, `fill_bitmasks` computes, off the GIL and in parallel, one bit per
   vocabulary id (1 = allowed) for every sampling row that has a grammar.
2. The sampler sets the logits of disallowed ids to -inf before anything else.
3. When the scheduler appends the sampled token, the request's grammar consumes it.

The grammar library is llguidance (no dependencies of its own; compiles a tool schema in about
a millisecond on CPU; `bench/structured.py` has the figures). Its compiler recurses once per
link of a chain of rules or `$ref`s and overflows its thread's stack on a long enough chain
(about 930 nested `$ref` objects or 2,600 chained Lark rules in 8 MiB), which kills the
process. So grammars compile on one thread of `COMPILE_STACK_BYTES` (64 MiB: eight times the
depth that the front end's sandbox admits, `shoal.deploy.openai.grammar_sandbox`). This module
knows nothing of the scheduler or the model; it imports no torch.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from shoal.engine.errors import RequestError
from shoal.engine.protocol import StructuredOutputsParams

# Mask bits per word of the bitmask (llguidance's layout: little-endian int32 words).
BITS_PER_WORD = 32

# The stack of the thread that compiles grammars. Only the pages a compile touches are ever
# committed; a front end admits only constraints that compile in an eighth of it.
COMPILE_STACK_BYTES = 64 << 20

T = TypeVar("T")


class RequestGrammar:
    """One request's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, matcher: Any, compiler: GrammarCompiler) -> None:
        self._matcher = matcher
        self.compiler = compiler

    def accept(self, token_id: int) -> bool:
        """Consumes a sampled token; False (and the grammar is broken) if it was not allowed."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more (EOS consumed, or no extension)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self._matcher.get_error()) if self._matcher.is_error() else None

    @property
    def matcher(self) -> Any:
        return self._matcher


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` into `RequestGrammar`s for one model's vocabulary.

    Args:
        tokenizer_json: the model's `tokenizers` JSON (tokenizer.json, or a GGUF's rebuilt one).
        vocab_size: the model's logits width (may exceed the tokenizer's, for padding ids).
        eos_token_ids: ids that end generation; a complete grammar allows only these.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance

        self._llg = llguidance
        eos = list(eos_token_ids) or None
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        # A few threads: masks are small work, and the forward pass they overlap needs the cores.
        self._executor = llguidance.LLExecutor(num_threads=min(4, os.cpu_count() or 1))
        self._compile_thread = DeepStackThread("shoal-grammar-compile", COMPILE_STACK_BYTES)

    def compile(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh grammar state for one request.

        Raises:
            RequestError: the schema, regex or grammar is invalid (the compiler's message).
        """
        grammar = grammar_text(params)
        matcher = self._compile_thread.run(self._matcher, grammar)
        if matcher.is_error():
            raise RequestError(f"structured_outputs does not compile: {matcher.get_error()}")
        return RequestGrammar(matcher, self)

    def close(self) -> None:
        """Ends the compile thread (after the call it runs, if any)."""
        self._compile_thread.close()

    def _matcher(self, grammar: str) -> Any:
        return self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)

    def fill_bitmasks(self, grammars: Sequence[RequestGrammar]) -> np.ndarray:
        """The allowed-token bitmask of each grammar, computed in parallel without the GIL.

        Returns:
            int32 [len(grammars), ceil(vocab_size / 32)]; bit j of word w allows id 32*w + j.
        """
        num_words = (self.vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD
        bitmask = np.full((len(grammars), num_words), -1, dtype=np.int32)
        if grammars:
            assert all(g.compiler is self for g in grammars), "grammars of another vocabulary"
            self._executor.unsafe_compute_mask_ptr(
                [(g.matcher, i) for i, g in enumerate(grammars)],
                bitmask.ctypes.data,
                num_words * 4,
                len(grammars),
            )
        return bitmask


def fill_bitmasks(grammars: Sequence[RequestGrammar]) -> np.ndarray:
    """`GrammarCompiler.fill_bitmasks` of the grammars' own compiler (one per engine)."""
    assert grammars, "no grammar to mask"
    return grammars[0].compiler.fill_bitmasks(grammars)


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for `params` (text only: nothing is compiled yet).

    Raises:
        RequestError: a JSON schema that is not a JSON object, or one llguidance refuses.
    """
    import llguidance

    matcher_cls = llguidance.LLMatcher
    if params.json is not None or params.json_object:
        schema: Any = {"type": "object"} if params.json_object else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise RequestError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise RequestError("the JSON schema must be a JSON object")
        options: Any = {"whitespace_flexible": params.whitespace_flexible}
        try:
            return str(matcher_cls.grammar_from_json_schema(schema, defaults=options))
        except ValueError as e:
            raise RequestError(f"the JSON schema does not compile: {e}") from e
    if params.regex is not None:
        return str(matcher_cls.grammar_from_regex(params.regex))
    if params.choice is not None:
        return str(matcher_cls.grammar_from_lark(_choice_lark(params.choice)))
    assert params.grammar is not None, "StructuredOutputsParams has one kind set"
    return str(matcher_cls.grammar_from_lark(params.grammar))


class DeepStackThread:
    """One daemon thread with a stack of its own size, running the calls handed to it in turn.

    Python's `threading.stack_size` is process-wide, so it is set only around this thread's
    start, under a lock.

    Args:
        name: the thread's name.
        stack_bytes: its stack size.
    """

    _start_lock = threading.Lock()

    def __init__(self, name: str, stack_bytes: int) -> None:
        # A call and its future; None ends the thread.
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        thread = threading.Thread(target=self._serve, name=name, daemon=True)
        with DeepStackThread._start_lock:
            previous = threading.stack_size(stack_bytes)
            try:
                thread.start()
            finally:
                threading.stack_size(previous)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread; blocks until it returns, and raises what it raises."""
        future: Future[T] = Future()
        self._calls.put((lambda: fn(*args), future))
        return future.result()

    def close(self) -> None:
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            try:
                future.set_result(call())
            except BaseException as e:  # handed to the caller, who raises it
                future.set_exception(e)


def _choice_lark(choices: Sequence[str]) -> str:
    """A Lark grammar whose language is exactly `choices`."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class LazyGrammarCompiler:
    """Builds the `GrammarCompiler` on first use: unconstrained engines never read the
    tokenizer or load the library. Thread-safe (the engine's input thread may compile)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarCompiler:
        """The compiler.

        Raises:
            ModelLoadError: the tokenizer cannot be read.
        """
        with self._lock:
            if self._compiler is None:
                from shoal.engine.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(self._tokenizer_path)
                self._compiler = GrammarCompiler(
                    str(tokenizer.backend.to_str()), self._vocab_size, self._eos_token_ids
                )
            return self._compiler

    def close(self) -> None:
        """Ends the compiler's thread, if it was built."""
        with self._lock:
            if self._compiler is not None:
                self._compiler.close()
                self._compiler = None
