"""One bad HTTP client, full size, against a real `shoal serve --port` with its default limits.

Each attack runs while a canary client asks for `/health` and a two-token completion on a fresh
connection each, retrying a reset or a 503 for up to 2 s (`tests/security/http_client.py`).
Printed per attack: what the server did (its answer and how long it took, or how many of the
attacker's connections it still held), and the canary's baseline figure beside its figure under
attack: its longest wait and its errors. Exits non-zero if any canary request failed.

    .venv/bin/python bench/attack.py [--only n,body,tokenize,slow,idle,resize,types,\
        schema,grammar,fanout] [--idle-connections 19000] [--slow-connections 600] \
        [--tokenize-mb 7] [--data-parallel-size 2]

The attacks are those the front end was hardened against: `n` = 30,000; a 20 MB body; three
7 MB `/tokenize` posts (just under the 8 MiB body cap), with the front end's resident memory
before, at its peak and after; 600 connections sending their headers a byte a second; 19,000
idle connections (this machine's file limit is 20,000); a resize to 1,000,000 ranks; a lone
surrogate, `"stream": "yes"`, and `/openapi.json` without the key. And the poison requests:
a `response_format` JSON schema whose `$defs` chain 1,000 objects deep and a `guided_grammar`
of 20,000 chained Lark rules (each crashes llguidance's compiler), each sent twice; 1,024
prompts x `n`=128 (131,072 sequences). After each poison attack the registry's rank failures
are counted: any is an engine death the attack caused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu import cpu_kind  # noqa: E402
from tests.deploy.openai_utils import (  # noqa: E402
    FrontEnd,
    http_status,
    request_json,
    start_shoal,
)
from tests.factories import make_tiny_checkpoint  # noqa: E402
from tests.ray_utils import (  # noqa: E402
    TINY_ENGINE_FLAGS,
    RayHead,
    ray_env,
    start_ray_head,
    stop_ray_head,
    unique_namespace,
)
from tests.security.http_client import Canary, raw_http  # noqa: E402
from tests.security.poison_inputs import (  # noqa: E402
    CRASHING_LARK_LENGTH,
    CRASHING_SCHEMA_LENGTH,
    lark_chain,
    ref_chain_schema,
)

API_KEY = "bench-attack-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
READ_TIMEOUT_S = 30.0  # the server's default --http-read-timeout


def _post(front_end: FrontEnd, path: str, body: Any, timeout_s: float = 120.0) -> tuple[int, Any]:
    return request_json(f"{front_end.base_url}{path}", body, AUTH, timeout_s=timeout_s)


def machine() -> str:
    """The CPU, its vector flags, the cores for this process, and the load average."""
    return cpu_kind()


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


def _rss_mb(front_end: FrontEnd) -> float:
    """The resident memory of the serving process (the front end, its cluster's driver)."""
    with open(f"/proc/{front_end.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def attack_tokenize(front_end: FrontEnd, args: argparse.Namespace) -> str:
    text = "the quick brown fox, " * (args.tokenize_mb * 1_000_000 // 21)
    health: list[float] = []
    before = peak = _rss_mb(front_end)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_post, front_end, "/tokenize", {"prompt": text}) for _ in range(3)]
        start = time.monotonic()
        while not all(f.done() for f in futures):
            _, took = _timed(lambda: http_status(f"{front_end.base_url}/health"))
            health.append(took)
            peak = max(peak, _rss_mb(front_end))
            time.sleep(0.05)
        statuses = [f.result()[0] for f in futures]
    took_s = time.monotonic() - start
    time.sleep(1.0)  # the last answer leaves the server
    return (
        f"3 x {args.tokenize_mb} MB /tokenize answered {statuses} in {took_s:.1f} s; "
        f"/health at most {max(health, default=0) * 1000:.0f} ms over {len(health)} probes; "
        f"front end {before:.0f} MB before, {peak:.0f} MB at most, {_rss_mb(front_end):.0f} "
        "MB after"
    )


def _rank_failures(front_end: FrontEnd, head: RayHead, namespace: str) -> int:
    """The rank failures the cluster's registry has recorded."""
    status = subprocess.run(
        [sys.executable, "-m", "shoal.deploy", "status", "--namespace", namespace, "--json",
         "--address", head.gcs_address],
        capture_output=True, text=True, env=ray_env(), cwd=ROOT, timeout=120,
    )  # fmt: skip
    return len(json.loads(status.stdout)["rank_failures"]) if status.returncode == 0 else -1


def _poison(front_end: FrontEnd, args: argparse.Namespace, path: str, body: Any) -> str:
    answers = []
    for _ in range(2):  # the second is refused from the sandbox's memory
        (status, _), took = _timed(lambda: _post(front_end, path, body))
        answers.append(f"{status} in {took * 1000:.0f} ms")
    size_kb = len(json.dumps(body)) / 1000
    deaths = _rank_failures(front_end, args.head, args.namespace)
    return f"{size_kb:.0f} KB body answered {', then '.join(answers)}; {deaths} rank failures"


def attack_schema(front_end: FrontEnd, args: argparse.Namespace) -> str:
    schema = ref_chain_schema(CRASHING_SCHEMA_LENGTH)
    body = {
        "messages": [{"role": "user", "content": "a city"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    return _poison(front_end, args, "/v1/chat/completions", body)


def attack_grammar(front_end: FrontEnd, args: argparse.Namespace) -> str:
    body = {"prompt": "a", "max_tokens": 8, "guided_grammar": lark_chain(CRASHING_LARK_LENGTH)}
    return _poison(front_end, args, "/v1/completions", body)


def attack_fanout(front_end: FrontEnd, args: argparse.Namespace) -> str:
    before = _rss_mb(front_end)
    body = {"prompt": ["a"] * 1024, "n": 128, "max_tokens": 4}
    (status, _), took = _timed(lambda: _post(front_end, "/v1/completions", body))
    refused = _rss_mb(front_end)
    at_cap = {"prompt": ["a"] * 8, "n": 128, "max_tokens": 4}  # the default cap, 1,024
    (cap_status, _), cap_took = _timed(lambda: _post(front_end, "/v1/completions", at_cap))
    return (
        f"1024 prompts x n=128 answered {status} in {took * 1000:.0f} ms (front end "
        f"{before:.0f} MB before, {refused:.0f} MB after); at the cap, 8 x n=128 answered "
        f"{cap_status} in {cap_took:.1f} s (front end {_rss_mb(front_end):.0f} MB after)"
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
    "schema": attack_schema,
    "grammar": attack_grammar,
    "fanout": attack_fanout,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(ATTACKS), help="attacks to run, by name")
    parser.add_argument("--idle-connections", type=int, default=19_000)
    parser.add_argument("--slow-connections", type=int, default=600)
    parser.add_argument("--tokenize-mb", type=int, default=7, help="each /tokenize post's size")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = Path(tempfile.mkdtemp(prefix="shoal-attack-"))
    checkpoint = make_tiny_checkpoint(root / "tiny-llama", "llama")
    (root / "api.key").write_text(API_KEY)
    head = start_ray_head()
    args.head, args.namespace = head, unique_namespace("attack")
    args_serve = [
        "serve", "--model", checkpoint, "--namespace", args.namespace,
        "--data-parallel-size", str(args.data_parallel_size),
        "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1",
        "--api-key-file", str(root / "api.key"), *TINY_ENGINE_FLAGS,
    ]  # fmt: skip
    num_failed = 0
    print(f"{machine()}; {args.data_parallel_size} ranks of a tiny Llama")
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
