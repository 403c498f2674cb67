"""`GrammarSandbox`: a front end's output constraints are compiled first where a crash costs
only that request.

llguidance recurses once per link of a chain of `$ref`s or Lark rules and overflows its
stack on a long one, which kills the process compiling it. Before a constrained request is
routed, the front end has it compiled in a child process (`grammar_check`, on a stack an
eighth of the engine's): a constraint that does not compile, crashes the child, or takes
longer than `CHECK_TIMEOUT_S` is a 400 for that request alone, and the child is started
again. Whatever passes, the engines compile with room to spare.

Each check's verdict is remembered by the constraint's digest (`CACHE_SIZE` of them), so the
usual case, the same schema on every request, costs a hash; a crashing constraint sent again
is refused from memory, without a child. At most `max_pending` checks wait or run (503 past
that); `num_workers` children run them.

Per worker slot, a state machine:

    (empty) --first check--> STARTING --> IDLE --check--> BUSY --answer--> IDLE
                                ^                           |
                                +----- crash or timeout ----+   (a new child starts at once)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import sys
from collections import OrderedDict
from http import HTTPStatus

import msgspec

from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.grammar_check import (
    SANDBOX_MEMORY_BYTES,
    SANDBOX_STACK_BYTES,
    CheckRequest,
    CheckResult,
    frame,
)
from shoal.engine.core.rate_limit import LogRateLimiter
from shoal.engine.protocol import StructuredOutputsParams

logger = logging.getLogger(__name__)
_refusals = LogRateLimiter(logger)

# A check that takes longer is refused (a tool schema takes 1-4 ms; the longest chains that
# fit the sandbox's stack, 0.1-0.3 s).
CHECK_TIMEOUT_S = 5.0
CACHE_SIZE = 1024
DEFAULT_NUM_WORKERS = 1
DEFAULT_MAX_PENDING = 64
_START_TIMEOUT_S = 60.0


class _Child:
    """One running `grammar_check` process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self.stdin = process.stdin
        self.stdout = process.stdout

    @classmethod
    async def start(cls) -> _Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shoal.deploy.openai.grammar_check",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def check(self, body: bytes) -> CheckResult | None:
        """The child's verdict; None if it died on the way (the constraint crashed it)."""
        try:
            self.stdin.write(frame(body))
            await self.stdin.drain()
            header = await self.stdout.readexactly(4)
            reply = await self.stdout.readexactly(int.from_bytes(header, "big"))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return msgspec.msgpack.decode(reply, type=CheckResult)

    async def kill(self) -> int:
        """Ends the child; its exit status (a negative signal number for a crash)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.stdin.close()
        return await self.process.wait()


class GrammarSandbox:
    """Compiles constraints in child processes before their requests are routed.

    Args:
        num_workers: child processes (each runs one check at a time).
        max_pending: checks waiting or running, at most; past it `check` raises (503).
        timeout_s: how long one check may run.
    """

    def __init__(
        self,
        num_workers: int = DEFAULT_NUM_WORKERS,
        max_pending: int = DEFAULT_MAX_PENDING,
        timeout_s: float = CHECK_TIMEOUT_S,
    ) -> None:
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self._num_pending = 0
        # Digest -> (the compiler's message or None, whether it crashed or ran too long).
        self._verdicts: OrderedDict[bytes, tuple[str | None, bool]] = OrderedDict()
        # A slot per worker: the start of its child (done once the child runs).
        self._slots: asyncio.Queue[asyncio.Task[_Child]] | None = None
        self._num_workers = num_workers
        self._children: set[_Child] = set()
        self._is_closed = False
        self.num_crashes = 0  # children a constraint killed or that ran past the timeout
        self.num_checks = 0  # checks run in a child (not answered from memory)
        self.num_poisoned = 0  # requests refused for a constraint that crashed or ran too long

    async def check(self, params: StructuredOutputsParams | None) -> None:
        """Returns if `params` compiles (or is None).

        Raises:
            OpenAIError: it does not compile, crashed the compiler or took too long (400);
                `max_pending` checks are under way already (503).
        """
        if params is None:
            return
        body = msgspec.msgpack.encode(CheckRequest(params))
        digest = hashlib.blake2b(body, digest_size=16).digest()
        if digest in self._verdicts:
            self._verdicts.move_to_end(digest)
            error, is_poison = self._verdicts[digest]
        else:
            error, is_poison = await self._check_in_child(body)
            self._remember(digest, (error, is_poison))
        self.num_poisoned += is_poison
        if error is not None:
            raise OpenAIError(error, param="structured_outputs")

    def close(self) -> None:
        """Ends every child at once (each also ends by itself once this process's end of its
        pipe closes); `aclose` waits for them too."""
        self._is_closed = True
        for child in self._children:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
        self._children.clear()

    async def aclose(self) -> None:
        """Ends every child and waits for it."""
        self._is_closed = True
        while self._children:
            await self._children.pop().kill()

    def _remember(self, digest: bytes, verdict: tuple[str | None, bool]) -> None:
        self._verdicts[digest] = verdict
        if len(self._verdicts) > CACHE_SIZE:
            self._verdicts.popitem(last=False)

    async def _check_in_child(self, body: bytes) -> tuple[str | None, bool]:
        """(the compiler's message or None, whether the constraint crashed or ran too long)."""
        if self._num_pending >= self.max_pending:
            raise OpenAIError(
                f"{self.max_pending} output constraints are being compiled; retry shortly",
                HTTPStatus.SERVICE_UNAVAILABLE,
                code="grammar_check_busy",
            )
        self._num_pending += 1
        try:
            return await self._check_in_slot(body)
        finally:
            self._num_pending -= 1

    async def _check_in_slot(self, body: bytes) -> tuple[str | None, bool]:
        """Waits for a worker's child to be free (or started), and checks in it."""
        slots = self._get_slots()
        starting = await slots.get()
        try:
            child = await asyncio.wait_for(asyncio.shield(starting), _START_TIMEOUT_S)
            try:
                return await self._run(child, body)
            except BaseException:  # cancelled mid-check: its answer would reach the next one
                self._children.discard(child)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
                raise
        finally:
            if self._is_gone(starting):
                starting = self._start_child()  # the next check need not wait for it
            slots.put_nowait(starting)

    def _is_gone(self, starting: asyncio.Task[_Child]) -> bool:
        """Whether a slot's child failed to start, or started and is gone since."""
        if not starting.done():
            return False
        if starting.cancelled() or starting.exception() is not None:
            return True
        return starting.result() not in self._children

    def _get_slots(self) -> asyncio.Queue[asyncio.Task[_Child]]:
        if self._slots is None:  # made in the serving loop, on the first check
            self._slots = asyncio.Queue()
            for _ in range(self._num_workers):
                self._slots.put_nowait(self._start_child())
        return self._slots

    def _start_child(self) -> asyncio.Task[_Child]:
        return asyncio.ensure_future(self._started_child())

    async def _started_child(self) -> _Child:
        child = await _Child.start()
        if self._is_closed:
            await child.kill()
            raise RuntimeError("the grammar sandbox is closed")
        self._children.add(child)
        return child

    async def _run(self, child: _Child, body: bytes) -> tuple[str | None, bool]:
        """One check's verdict; a child that crashed or ran too long is gone after it."""
        self.num_checks += 1
        try:
            result = await asyncio.wait_for(child.check(body), self.timeout_s)
        except TimeoutError:
            await self._lose(child, f"took longer than {self.timeout_s:.0f} s")
            message = (
                f"structured_outputs took longer than {self.timeout_s:.0f} s to compile; "
                "this server refuses it"
            )
            return message, True
        if result is None:
            status = await self._lose(child, "crashed")
            message = (
                "structured_outputs crashed the grammar compiler (exit status "
                f"{status}): it nests or chains deeper than a {SANDBOX_STACK_BYTES >> 20} MiB "
                f"stack, or needs more than {SANDBOX_MEMORY_BYTES >> 30} GiB, to compile"
            )
            return message, True
        return result.error, False

    async def _lose(self, child: _Child, why: str) -> int:
        self.num_crashes += 1
        self._children.discard(child)
        status = await child.kill()
        _refusals.warning("grammar-check", "an output constraint %s its compile; refused", why)
        return status
