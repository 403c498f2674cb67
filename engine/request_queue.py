"""The scheduler's waiting queue under `--scheduling-policy`: first come first served, or by
priority (vLLM's policies). Knows requests only by their priority and arrival; no torch.

    fcfs:      arrival order; a preempted request goes back to the front.
    priority:  ascending (priority, arrival_time), ties in the order taken in; a preempted
               request goes back in its place by the same key, so a more urgent request that
               arrived meanwhile still goes first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from shoal.engine.config import SchedulingPolicy
from shoal.engine.request import Request


class RequestQueue(Protocol):
    """Waiting requests in the order the scheduler takes them (`peek` first)."""

    def add(self, request: Request) -> None:
        """Queues a request taken in."""

    def add_preempted(self, request: Request) -> None:
        """Queues a request whose blocks were taken back (it runs again before newcomers)."""

    def peek(self) -> Request:
        """The next request to admit. Raises IndexError when empty."""

    def pop(self) -> Request:
        """Takes the next request off. Raises IndexError when empty."""

    def remove(self, request: Request) -> None:
        """Takes a queued request off wherever it is (an abort)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]:
        """Every queued request; in order for FCFS, in no particular order for priority."""


class FCFSRequestQueue:
    """Arrival order (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """A heap on (priority, arrival_time, order taken in) (see the module docstring)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._order), request)
        heapq.heappush(self._heap, key)

    def add_preempted(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{request} is not queued")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)


def make_request_queue(policy: SchedulingPolicy) -> FCFSRequestQueue | PriorityRequestQueue:
    """The waiting queue of `policy`."""
    if policy == "priority":
        return PriorityRequestQueue()
    return FCFSRequestQueue()


def running_order_key(request: Request) -> tuple[int, float]:
    """Priority scheduling keeps the running list in this order, so its last request is the
    one to preempt first: the least urgent, and of those the latest to arrive (as vLLM picks
    its victim)."""
    return request.priority, request.arrival_time
