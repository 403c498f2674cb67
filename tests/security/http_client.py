"""HTTP peers for the front end's attack tests and `bench/attack.py`: a canary client that
must keep being served, and raw requests a well-behaved client library would not send."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tests.deploy.openai_utils import request_json

# How long the canary may wait for any one answer, retries included.
CANARY_BUDGET_S = 2.0


class Canary:
    """A client asking for `/health` and a two-token completion, one after the other, on a
    fresh connection each, for as long as an attack runs. Like any client it retries a reset
    connection or a 503 (a flood's side effects), but each request must succeed within
    `budget_s` (2 s; a test that judges only whether the canary is served gives it more, and
    leaves the figure to `bench/attack.py`)."""

    def __init__(self, base_url: str, api_key: str, budget_s: float = CANARY_BUDGET_S) -> None:
        self.base_url = base_url
        self.budget_s = budget_s
        self.auth = {"Authorization": f"Bearer {api_key}"}
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        assert self.latencies, "the canary made no request"
        assert not self.errors, self.errors
        assert self.max_latency_s < self.budget_s, self.max_latency_s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    @contextlib.contextmanager
    def running(self) -> Iterator[Canary]:
        """Runs the canary for the block without judging it (a benchmark prints it)."""
        self._thread.start()
        try:
            yield self
        finally:
            self.stop()

    @property
    def max_latency_s(self) -> float:
        return max(self.latencies, default=0.0)

    def _run(self) -> None:
        body = {"prompt": "canary", "max_tokens": 2, "temperature": 0.0}
        urls = {f"{self.base_url}/health": None, f"{self.base_url}/v1/completions": body}
        while not self._stop.is_set():
            for url, data in urls.items():
                self._served_within_budget(url, data)
            self._stop.wait(0.05)

    def _served_within_budget(self, url: str, data: dict[str, Any] | None) -> None:
        start = time.monotonic()
        outcome = ""
        while time.monotonic() - start < self.budget_s:
            try:
                status, _ = request_json(url, data, self.auth, timeout_s=self.budget_s)
            except OSError as e:
                outcome = repr(e)
            else:
                if status == 200:
                    self.latencies.append(time.monotonic() - start)
                    return
                outcome = str(status)
                if status != 503:
                    break
            time.sleep(0.05)
        self.latencies.append(time.monotonic() - start)
        self.errors.append(f"{url}: {outcome}")


def raw_http(
    port: int, head: bytes, chunks: Sequence[bytes] = (), timeout_s: float = 10.0
) -> bytes:
    """Sends a request head and body chunks on a fresh connection; returns the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        for chunk in chunks:
            sock.sendall(chunk)
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
        return reply
