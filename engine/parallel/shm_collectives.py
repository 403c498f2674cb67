"""`ShmCollectives`: all-reduce and all-gather between the CPU workers of one tensor-parallel
rank through shared memory, the path a decode step's many small collectives take.

Why. A rank's workers always share a node (their bundles are packed), and a decode step of a
Llama runs two all-reduces per layer on a few kilobytes each. Over gloo each costs a thread
handoff and a TCP round trip: ~1.7 ms on a loaded two-core machine, more than the layer's
matmuls. Here each costs two memory copies and a spin on a flag.

Layout: one file in /dev/shm, mapped by every worker and unlinked once all have mapped it (so
nothing outlives them): a flag per worker (an int64 on its own cache line), then two sets
("parities") of one data slot per worker, `SLOT_BYTES` each.

Protocol, per collective (every worker runs the same collectives in the same order, so their
sequence numbers agree):

1. `seq += 1`; the worker copies its tensor into its slot of parity `seq % 2`, then stores
   `seq` in its flag (x86 keeps stores in program order, and loads too: a peer that sees the
   flag sees the data; other machines take the gloo path).
2. It spins until every flag is >= `seq` (yielding the core after a few spins, and failing
   after `timeout_s` or once `close` was called, e.g. by the monitor of a dead worker).
3. It reads every worker's slot in worker order: all-reduce sums them (the same order on every
   worker, so every worker ends with the same bits), all-gather concatenates them.

A slot is written again two collectives later, and by then every worker has read it: a worker
passes step 2 of collective k+1 only after every worker stored flag k+1, which each does only
after it finished reading collective k. Tensors larger than a slot go over gloo.

Knows nothing of models or processes beyond the store it meets its peers at.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
from datetime import timedelta

import numpy as np
import torch
from torch.distributed import Store

# Bytes of one worker's slot: a decode or a modest prefill batch's hidden states fit; larger
# tensors take the gloo path.
SLOT_BYTES = 4 * 1024 * 1024
_FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each
_SPINS_BEFORE_YIELD = 200
_TIMEOUT_CHECK_SPINS = 2048
_PATH_KEY = "shm/path"


def shm_supported() -> bool:
    """Whether this machine orders plain stores and loads as the protocol needs (x86)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class CollectiveTimeoutError(RuntimeError):
    """A tensor-parallel peer did not reach a collective in time, or the group was closed."""


class ShmCollectives:
    """One worker's view of its rank's shared-memory collectives.

    Build with `join` (every worker of the rank, with the same store).
    """

    def __init__(self, buffer: mmap.mmap, rank: int, size: int, timeout_s: float) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._buffer = buffer
        flags_bytes = size * _FLAG_STRIDE * 8
        self._flags = np.frombuffer(buffer, dtype=np.int64, count=size * _FLAG_STRIDE)
        data = torch.frombuffer(buffer, dtype=torch.uint8, offset=flags_bytes)
        self._slots = [
            [
                data[(p * size + r) * SLOT_BYTES : (p * size + r + 1) * SLOT_BYTES]
                for r in range(size)
            ]
            for p in range(2)
        ]
        self._seq = 0
        self._closed = False

    @classmethod
    def join(
        cls, store: Store, rank: int, size: int, timeout_s: float, join_timeout_s: float = 180.0
    ) -> ShmCollectives:
        """Maps the rank's shared file: worker 0 creates it and names it in `store`, the others
        map it, and worker 0 unlinks it once all have (within `join_timeout_s`). Collectives
        wait `timeout_s` for a peer.

        Raises:
            RuntimeError (from the store): a peer did not come in time.
        """
        total = size * _FLAG_STRIDE * 8 + 2 * size * SLOT_BYTES
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="shoal-tp-", dir="/dev/shm")
            try:
                os.ftruncate(fd, total)
                buffer = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            store.set(_PATH_KEY, path)
        else:
            path = store.get(_PATH_KEY).decode()
            fd = os.open(path, os.O_RDWR)
            try:
                buffer = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        store.set(f"shm/mapped/{rank}", "1")
        if rank == 0:
            keys = [f"shm/mapped/{r}" for r in range(size)]
            store.wait(keys, timedelta(seconds=join_timeout_s))
            os.unlink(path)
        return cls(buffer, rank, size, timeout_s)

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the workers, in place (worker order: the same bits everywhere)."""
        parts = self._exchange(tensor)
        tensor.copy_(parts[0])
        for part in parts[1:]:
            tensor.add_(part)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every worker's `tensor` side by side along the last dimension, by worker."""
        return torch.cat(self._exchange(tensor), dim=-1)

    def close(self) -> None:
        """Fails collectives waiting now and later. Idempotent."""
        self._closed = True

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Publishes `tensor`, waits for every worker's, returns views of all of them (valid
        until the collective after next)."""
        if self._closed:
            raise CollectiveTimeoutError("the tensor-parallel group is closed")
        self._seq += 1
        seq = self._seq
        nbytes = tensor.numel() * tensor.element_size()
        slots = self._slots[seq % 2]
        local = tensor.contiguous()
        slots[self.rank][:nbytes].view(tensor.dtype).view(tensor.shape).copy_(local)
        self._flags[self.rank * _FLAG_STRIDE] = seq
        self._wait(seq)
        return [s[:nbytes].view(tensor.dtype).view(tensor.shape) for s in slots]

    def _wait(self, seq: int) -> None:
        flags, stride = self._flags, _FLAG_STRIDE
        others = [r * stride for r in range(self.size) if r != self.rank]
        spins = 0
        deadline = 0.0
        while True:
            if all(flags[i] >= seq for i in others):
                return
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()
            if spins % _TIMEOUT_CHECK_SPINS == 0:
                now = time.monotonic()
                if deadline == 0.0:
                    deadline = now + self.timeout_s
                elif now > deadline or self._closed:
                    raise CollectiveTimeoutError(
                        f"a tensor-parallel peer did not reach collective {seq} within "
                        f"{self.timeout_s:.0f} s"
                        if not self._closed
                        else "the tensor-parallel group is closed"
                    )
