"""One bad HTTP client, full size, against a real `shoal serve --port` with its default limits.

Each attack runs while a canary client asks for `/health` and a two-token completion on a fresh
connection each, retrying a reset or a 503 for up to 2 s (`tests/security/http_client.py`).
Printed per attack: what the server did (its answer and how long it took, or how many of the
attacker's connections it still held), and the canary's baseline figure beside its figure under
attack: its longest wait and its errors. Exits non-zero if any canary request failed.

    .venv/bin/python bench/attack.py [--only n,body,tokenize,slow,idle,resize,types] \
        [--idle-connections 19000] [--slow-connections 600]

The attacks are those the front end was hardened against: `n` = 30,000; a 20 MB body; three
7 MB `/tokenize` posts (just under the 8 MiB body cap); 600 connections sending their headers
a byte a second; 19,000 idle connections (this machine's file limit is 20,000); a resize to
1,000,000 ranks; a lone surrogate, `"stream": "yes"`, and `/openapi.json` without the key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.deploy.openai_utils import (  # noqa: E402
    FrontEnd,
    http_status,
    request_json,
    start_shoal,
)
from tests.factories import make_tiny_checkpoint  # noqa: E402
from tests.ray_utils import (  # noqa: E402
    TINY_ENGINE_FLAGS,
    start_ray_head,
    stop_ray_head,
    unique_namespace,
)
from tests.security.http_client import Canary, raw_http  # noqa: E402

API_KEY = "bench-attack-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
READ_TIMEOUT_S = 30.0  # the server's default --http-read-timeout


def _post(front_end: FrontEnd, path: str, body: Any, timeout_s: float = 120.0) -> tuple[int, Any]:
    return request_json(f"{front_end.base_url}{path}", body, AUTH, timeout_s=timeout_s)


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def attack_n(front_end: FrontEnd, args: argparse.Namespace) -> str:
    (status, _), took = _timed(
        lambda: _post(front_end, "/v1/completions", {"prompt": "a", "n": 30_000, "max_tokens": 4})
    )
    return f"n=30000 answered {status} in {took * 1000:.0f} ms"


def attack_body(front_end: FrontEnd, args: argparse.Namespace) -> str:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {20_000_000}\r\n\r\n"
    ).encode()
    reply, took = _timed(lambda: raw_http(front_end.port, head))
    status = reply.split(b" ", 2)[1].decode() if reply else "nothing"
    return f"20 MB body answered {status} in {took * 1000:.0f} ms"


def attack_tokenize(front_end: FrontEnd, args: argparse.Namespace) -> str:
    text = "the quick brown fox, " * (7_000_000 // 21)
    health: list[float] = []
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_post, front_end, "/tokenize", {"prompt": text}) for _ in range(3)]
        start = time.monotonic()
        while not all(f.done() for f in futures):
            _, took = _timed(lambda: http_status(f"{front_end.base_url}/health"))
            health.append(took)
            time.sleep(0.05)
        statuses = [f.result()[0] for f in futures]
    return (
        f"3 x 7 MB /tokenize answered {statuses} in {time.monotonic() - start:.1f} s; "
        f"/health at most {max(health, default=0) * 1000:.0f} ms over {len(health)} probes"
    )


@contextlib.contextmanager
def _connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            try:
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break  # out of descriptors here, or refused
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def _num_open(sockets: list[socket.socket]) -> int:
    num_open = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            num_open += sock.recv(1) != b""
        except BlockingIOError:
            num_open += 1
        except OSError:
            pass
    return num_open


def attack_slow(front_end: FrontEnd, args: argparse.Namespace) -> str:
    header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64
    with _connections(front_end.port, args.slow_connections) as sockets:
        deadline = time.monotonic() + READ_TIMEOUT_S + 3
        sent = 0
        while time.monotonic() < deadline:
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.send(header[sent % len(header) : sent % len(header) + 1])
            sent += 1
            time.sleep(1.0)
        return (
            f"{len(sockets)} slow-header connections: {_num_open(sockets)} open after "
            f"{READ_TIMEOUT_S + 3:.0f} s"
        )


def attack_idle(front_end: FrontEnd, args: argparse.Namespace) -> str:
    start = time.monotonic()
    with _connections(front_end.port, args.idle_connections) as sockets:
        opened_s = time.monotonic() - start
        time.sleep(2.0)
        return (
            f"{len(sockets)} idle connections (opened in {opened_s:.1f} s): the server holds "
            f"{_num_open(sockets)} of them"
        )


def attack_resize(front_end: FrontEnd, args: argparse.Namespace) -> str:
    (status, _), took = _timed(
        lambda: _post(front_end, "/scale_elastic_ep", {"new_data_parallel_size": 1_000_000})
    )
    return f"resize to 1000000 answered {status} in {took * 1000:.0f} ms"


def attack_types(front_end: FrontEnd, args: argparse.Namespace) -> str:
    stream_yes = _post(front_end, "/v1/completions", {"prompt": "a", "stream": "yes"})[0]
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\n"
    )
    body = b'{"prompt": "caf\\ud800", "max_tokens": 2}'
    raw = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    surrogate = raw_http(front_end.port, raw).split(b" ", 2)[1].decode()
    openapi = http_status(f"{front_end.base_url}/openapi.json")
    return f'"stream": "yes" {stream_yes}; lone surrogate {surrogate}; /openapi.json {openapi}'


ATTACKS: dict[str, Callable[[FrontEnd, argparse.Namespace], str]] = {
    "n": attack_n,
    "body": attack_body,
    "tokenize": attack_tokenize,
    "slow": attack_slow,
    "idle": attack_idle,
    "resize": attack_resize,
    "types": attack_types,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(ATTACKS), help="attacks to run, by name")
    parser.add_argument("--idle-connections", type=int, default=19_000)
    parser.add_argument("--slow-connections", type=int, default=600)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = Path(tempfile.mkdtemp(prefix="shoal-attack-"))
    checkpoint = make_tiny_checkpoint(root / "tiny-llama", "llama")
    (root / "api.key").write_text(API_KEY)
    head = start_ray_head()
    args_serve = [
        "serve", "--model", checkpoint, "--namespace", unique_namespace("attack"),
        "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1",
        "--api-key-file", str(root / "api.key"), *TINY_ENGINE_FLAGS,
    ]  # fmt: skip
    num_failed = 0
    try:
        front_end = start_shoal(head, args_serve, root / "serve.log")
        try:
            baseline = Canary(front_end.base_url, API_KEY)
            with baseline.running():
                time.sleep(3.0)
            print(f"{'canary, no attack':<12} max {baseline.max_latency_s * 1000:6.0f} ms")
            for name in args.only.split(","):
                canary = Canary(front_end.base_url, API_KEY)
                with canary.running():
                    effect = ATTACKS[name](front_end, args)
                num_failed += len(canary.errors)
                print(
                    f"{name:<12} canary max {canary.max_latency_s * 1000:6.0f} ms (baseline "
                    f"{baseline.max_latency_s * 1000:.0f} ms), {len(canary.errors)} errors "
                    f"of {len(canary.latencies)}; {effect}"
                )
                for error in canary.errors[:3]:
                    print(f"{'':<12} canary error: {error}")
        finally:
            front_end.stop()
            log = front_end.log.read_text(errors="replace")
            print(f"serve log: {len(log)} bytes, {log.count('Traceback')} tracebacks")
    finally:
        stop_ray_head(head)
    print(json.dumps({"canary_errors": num_failed}))
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
