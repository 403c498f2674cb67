"""The ZAP handler's thread ends before its context: a context destroyed under its poll
(`ctx.destroy` closes every socket from the calling thread) aborts the process inside libzmq
when a handshake is being answered at that moment (`Assertion failed: !_more`)."""

from __future__ import annotations

import subprocess
import sys
import threading

import zmq

from shoal.engine.core.curve import ClientCurve, CurveKeyPair
from tests.ray_utils import REPO_ROOT

# Peers handshake with a client's CURVE PULL (its ZAP handler answers each) while the client
# closes: the handler is stopped first, then the context destroyed, over and over.
_CLOSE_UNDER_HANDSHAKES = """
import zmq
from shoal.engine.core.curve import ClientCurve, CurveKeyPair, curve_client

keys, engine = CurveKeyPair.generate(), CurveKeyPair.generate()
peers = zmq.Context()
for i in range(120):
    ctx = zmq.Context()
    curve = ClientCurve(ctx, keys, "client")
    pull = ctx.socket(zmq.PULL)
    curve.secure_output_socket(pull)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    pushes = []
    for j in range(8):  # unknown keys: each handshake is a ZAP request and a refusal
        push = peers.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        curve_client(push, CurveKeyPair.generate(), keys.public)
        push.connect(f"tcp://127.0.0.1:{port}")
        pushes.append(push)
    assert curve.close(), "the ZAP handler did not stop"
    ctx.destroy(linger=0)
    for push in pushes:
        push.close()
print("closed", i + 1)
"""


def test_a_closed_handler_has_ended_and_its_context_may_go() -> None:
    ctx = zmq.Context()
    curve = ClientCurve(ctx, CurveKeyPair.generate(), "client under test")
    assert curve.close()
    assert not [t for t in threading.enumerate() if t.name == "ZapHandler[client under test]"]
    ctx.destroy(linger=0)


def test_closing_while_peers_handshake_never_aborts_the_process() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CLOSE_UNDER_HANDSHAKES],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "closed 120"
