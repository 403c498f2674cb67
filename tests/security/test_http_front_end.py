"""One bad HTTP client against a real `shoal serve --port`: each attack is refused or cut off
while a canary client keeps being served within 2 s (`shoal.deploy.openai.limits`,
`body_guard`, `connections`, `tokenizer_pool`, and the keys of `server`).

One served cluster (one rank of a tiny Llama) serves the whole module, with small limits so
each attack stays small: `--max-n 8`, a 1 MiB body cap, a 1.5 s read deadline, 1 s keep-alive
and 48 connections. Its keys come from files, as `ray job submit` users are told to pass them.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.deploy.openai_utils import FrontEnd, http_status, request_json, start_shoal
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import (
    REPO_ROOT,
    TINY_ENGINE_FLAGS,
    RayHead,
    ray_env,
    ray_head,
    unique_namespace,
)
from tests.security.http_client import Canary, raw_http

__all__ = ["ray_head"]

pytestmark = pytest.mark.slow

API_KEY = "inference-key-5f1d2c"
ADMIN_KEY = "admin-key-9a8b7c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 1024 * 1024
MAX_CONNECTIONS = 48
READ_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def namespace() -> str:
    return unique_namespace("http-attacks")


@pytest.fixture(scope="module")
def served(
    ray_head: RayHead, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontEnd]:
    root = tmp_path_factory.mktemp("served")
    checkpoint = make_tiny_checkpoint(root / "tiny-llama", "llama")
    (root / "api.key").write_text(API_KEY + "\n")
    (root / "admin.key").write_text(ADMIN_KEY)
    args = [
        "serve", "--model", checkpoint, "--namespace", namespace,
        "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1",
        "--api-key-file", str(root / "api.key"), "--admin-api-key-file", str(root / "admin.key"),
        "--max-n", "8", "--max-request-body-bytes", str(MAX_BODY),
        "--http-read-timeout", str(READ_TIMEOUT_S), "--timeout-keep-alive", "1",
        "--max-connections", str(MAX_CONNECTIONS), *TINY_ENGINE_FLAGS,
    ]  # fmt: skip
    front_end = start_shoal(ray_head, args, root / "serve.log")
    try:
        yield front_end
    finally:
        assert front_end.stop() == 0, front_end.output()


def _post(served: FrontEnd, path: str, body: Any, timeout_s: float = 30.0) -> tuple[int, Any]:
    return request_json(f"{served.base_url}{path}", body, AUTH, timeout_s=timeout_s)


def _error(reply: tuple[int, Any]) -> str:
    return str(reply[1]["error"]["message"])


def test_n_past_the_limit_is_a_400_naming_it_at_once(served: FrontEnd) -> None:
    with Canary(served.base_url, API_KEY):
        start = time.monotonic()
        reply = _post(served, "/v1/completions", {"prompt": "a", "n": 100_000, "max_tokens": 4})
        assert reply[0] == 400 and "--max-n" in _error(reply) and "8" in _error(reply), reply
        chat = {"messages": [{"role": "user", "content": "a"}], "n": 9}
        reply = _post(served, "/v1/chat/completions", chat)
        assert reply[0] == 400 and reply[1]["error"]["param"] == "n", reply
        assert time.monotonic() - start < 2.0
        status, body = _post(served, "/v1/completions", {"prompt": "a", "n": 8, "max_tokens": 2})
        assert status == 200 and len(body["choices"]) == 8


def test_a_body_past_the_cap_is_refused_by_its_length_or_once_it_passes_the_cap(
    served: FrontEnd,
) -> None:
    with Canary(served.base_url, API_KEY):
        start = time.monotonic()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\n"
        )
        declared = f"{head}Content-Length: {20 * MAX_BODY}\r\n\r\n".encode()
        assert raw_http(served.port, declared).startswith(b"HTTP/1.1 413")
        chunked = f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()
        piece = b"x" * 65536
        chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (MAX_BODY // len(piece) + 1)
        assert raw_http(served.port, chunked, chunks).startswith(b"HTTP/1.1 413")
        assert time.monotonic() - start < 5.0


def test_strict_json_types_and_invalid_unicode_are_400s(served: FrontEnd) -> None:
    with Canary(served.base_url, API_KEY):
        for field, value in (("stream", "yes"), ("n", "2"), ("max_tokens", True)):
            reply = _post(served, "/v1/completions", {"prompt": "a", field: value})
            assert reply[0] == 400 and field in _error(reply), (field, reply)
        raw = b'{"prompt": "caf\\ud800", "max_tokens": 2}'
        request = urllib.request.Request(
            f"{served.base_url}/v1/completions", raw, {**AUTH, "Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400, refused.value.read()
        assert "Unicode" in json.loads(refused.value.read())["error"]["message"]


def test_a_prompt_far_over_the_context_is_refused_before_it_is_tokenized(
    served: FrontEnd,
) -> None:
    with Canary(served.base_url, API_KEY):
        reply = _post(served, "/v1/completions", {"prompt": "word " * 150_000, "max_tokens": 2})
        assert reply[0] == 400 and "characters" in _error(reply), reply


def test_large_tokenize_requests_run_off_the_event_loop_and_need_the_key(
    served: FrontEnd,
) -> None:
    assert request_json(f"{served.base_url}/tokenize", {"prompt": "a"})[0] == 401
    text = "the quick brown fox, " * (MAX_BODY // 24)
    with ThreadPoolExecutor(3) as pool:
        began = time.monotonic()
        futures = [
            pool.submit(_post, served, "/tokenize", {"prompt": text}, 300.0) for _ in range(3)
        ]
        health: list[float] = []
        while not all(f.done() for f in futures):
            start = time.monotonic()
            assert http_status(f"{served.base_url}/health") == 200
            health.append(time.monotonic() - start)
            time.sleep(0.02)
        took = time.monotonic() - began
        counts = [f.result()[1]["count"] for f in futures]
    assert len(set(counts)) == 1 and counts[0] > 100_000
    # The loop stays free while the three calls tokenize: /health keeps answering, each time in
    # a small part of what the calls take together (relative, so a loaded machine slows both).
    assert len(health) >= 5 and max(health) < took / 4, (health, took)


def test_openapi_needs_the_key_and_resizes_need_the_admin_key(served: FrontEnd) -> None:
    assert http_status(f"{served.base_url}/openapi.json") == 401
    status, spec = request_json(f"{served.base_url}/openapi.json", headers=AUTH)
    assert status == 200 and "/v1/completions" in spec["paths"]
    scale = f"{served.base_url}/scale_elastic_ep"
    assert request_json(scale, {"new_data_parallel_size": 0}, AUTH)[0] == 401
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status, body = request_json(scale, {"new_data_parallel_size": 0}, admin)
    assert status == 400, body


def test_a_resize_past_what_ray_can_place_is_refused_at_once(served: FrontEnd) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with Canary(served.base_url, API_KEY):
        start = time.monotonic()
        status, body = request_json(
            f"{served.base_url}/scale_elastic_ep", {"new_data_parallel_size": 1_000_000}, admin
        )
        assert status == 400 and "hold 4 ranks" in body["error"]["message"], body
        assert time.monotonic() - start < 2.0
        status, body = request_json(f"{served.base_url}/is_scaling_elastic_ep", headers=admin)
        assert (status, body) == (200, {"is_scaling_elastic_ep": False})


def _is_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (BlockingIOError, TimeoutError):
        return False
    except OSError:
        return True


def test_slow_headers_idle_and_keep_alive_connections_are_closed(served: FrontEnd) -> None:
    with Canary(served.base_url, API_KEY):
        slow = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(10)]
        silent = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(10)]
        kept = socket.create_connection(("127.0.0.1", served.port))
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
        deadline = time.monotonic() + READ_TIMEOUT_S + 1.5
        sent = 0
        while time.monotonic() < deadline and sent < len(header):  # a byte each 0.1 s
            for sock in slow:
                with contextlib.suppress(OSError):
                    sock.sendall(header[sent : sent + 1])
            sent += 1
            time.sleep(0.1)
        for sock in [*slow, *silent, kept]:
            sock.settimeout(2.0)
        assert all(_is_closed(s) for s in slow), "a slow-header connection stayed open"
        assert all(_is_closed(s) for s in silent), "a silent connection stayed open"
        assert _is_closed(kept), "an idle keep-alive connection stayed open"
        for sock in [*slow, *silent, kept]:
            sock.close()


def test_past_the_connection_cap_idle_ones_make_room_and_busy_ones_mean_a_fast_503(
    served: FrontEnd,
) -> None:
    with Canary(served.base_url, API_KEY):
        flood = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(200)]
        time.sleep(0.3)
        for sock in flood:
            sock.setblocking(False)
        open_ = [s for s in flood if not _is_closed(s)]
        assert len(open_) <= MAX_CONNECTIONS, len(open_)
        for sock in flood:
            sock.close()
    # Every slot busy (bodies still arriving): a newcomer is answered 503 at once.
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n{{"
    ).encode()
    busy = []
    for _ in range(MAX_CONNECTIONS):
        sock = socket.create_connection(("127.0.0.1", served.port))
        sock.sendall(head)
        busy.append(sock)
    time.sleep(0.2)
    start = time.monotonic()
    status = http_status(f"{served.base_url}/health")
    assert status == 503 and time.monotonic() - start < 1.0, status
    for sock in busy:
        sock.close()
    time.sleep(0.3)
    assert http_status(f"{served.base_url}/health") == 200


def test_a_flood_of_malformed_requests_is_logged_once_with_a_count(served: FrontEnd) -> None:
    before = served.output().count("Invalid HTTP request")
    with Canary(served.base_url, API_KEY):
        for _ in range(50):
            assert raw_http(served.port, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert served.output().count("Invalid HTTP request") - before <= 1


def test_keys_from_files_appear_in_no_process_list_log_or_status(
    served: FrontEnd, ray_head: RayHead, namespace: str
) -> None:
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    status = subprocess.run(
        [sys.executable, "-m", "shoal.deploy", "status", "--namespace", namespace, "--json",
         "--address", ray_head.gcs_address],
        capture_output=True, text=True, env=ray_env(), cwd=REPO_ROOT, timeout=120,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    log = served.log.read_text(errors="replace")
    for key in (API_KEY, ADMIN_KEY):
        for where, text in (("ps", processes), ("status", status.stdout + status.stderr)):
            assert key not in text, where
        assert key not in log, "the serve log"
