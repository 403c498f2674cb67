"""A real `shoal serve --port` (and `shoal api-server`) on a `ray start --head` node, for the
OpenAI front-end tests; and reading `/metrics` with `prometheus_client`'s parser."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.ray_utils import REPO_ROOT, TINY_ENGINE_FLAGS, RayHead, free_port, ray_env

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
READY_TIMEOUT_S = 240.0


@dataclass
class FrontEnd:
    """A `shoal` process serving HTTP on 127.0.0.1:port."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_shoal(
    head: RayHead, args: Sequence[str], log: Path, auth_token: str | None = None
) -> FrontEnd:
    """Runs `python -m shoal.deploy ARGS --port P` (with Ray's `auth_token`, if given) and
    waits until `/health` answers 200."""
    front_end = spawn_shoal(head, args, log, auth_token)
    proc = front_end.proc
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"shoal exited {proc.returncode}:\n{front_end.output()}")
        if http_status(f"{front_end.base_url}/health") == 200:
            return front_end
        time.sleep(0.5)
    front_end.stop()
    raise AssertionError(f"no /health within {READY_TIMEOUT_S} s:\n{front_end.output()}")


def spawn_shoal(
    head: RayHead, args: Sequence[str], log: Path, auth_token: str | None = None
) -> FrontEnd:
    """Runs `python -m shoal.deploy ARGS --port P` against `head`; does not wait for it."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.deploy", *args, "--port", str(port),
             "--address", head.gcs_address],
            stdout=out, stderr=subprocess.STDOUT, env=ray_env(auth_token), cwd=REPO_ROOT,
        )  # fmt: skip
    return FrontEnd(proc, port, log)


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def request_json(
    url: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> tuple[int, Any]:
    """GET (no body) or POST a JSON body; returns (status, decoded JSON or None)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={**(headers or {})})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = int(response.status), response.read()
    except urllib.error.HTTPError as e:
        status, raw = int(e.code), e.read()
    return status, json.loads(raw) if raw else None


def scrape(base_url: str) -> dict[str, float]:
    """`/metrics`, parsed: each sample name with its labels → value."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels`."""
    wanted = [f"{k}={v}" for k, v in labels.items()]
    return sum(
        value
        for key, value in samples.items()
        if key.split("{", 1)[0] == name and all(w in key for w in wanted)
    )


@contextlib.contextmanager
def serving_two_ranks(
    head: RayHead, checkpoint: str, namespace: str, log_dir: Path
) -> Iterator[FrontEnd]:
    """`shoal serve --port` of `checkpoint` over two ranks, with the tests' key and model name;
    stopped (cleanly: exit 0) on exit."""
    args = [
        "serve", "--model", checkpoint, "--data-parallel-size", "2", "--namespace", namespace,
        "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1", "--api-key", API_KEY,
        "--served-model-name", MODEL_NAME, *TINY_ENGINE_FLAGS,
    ]  # fmt: skip
    front_end = start_shoal(head, args, log_dir / "serve.log")
    try:
        yield front_end
    finally:
        assert front_end.stop() == 0, front_end.output()
