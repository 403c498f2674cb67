"""The other data-plane sockets: a client's output PULL and the coordinator's stats sockets take
nothing from a peer without the cluster's keys; a client without keys is told at once; an engine
started by a client ends with it, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from shoal.actors.coordinator import CoordinatorActor
from shoal.client import SyncMPClient
from shoal.client.transport.mp_client import EngineAttachError
from shoal.engine.core.curve import CurveKeyPair, EngineKeys, curve_client
from shoal.engine.protocol import (
    ENGINE_CORE_DEAD,
    DPStatsSnapshot,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineStatsReport,
    FinishReason,
    SchedulerStats,
)
from shoal.engine.serial import MsgpackEncoder
from tests.engine.core_proc_utils import request, running_engine, tiny_config

REPO = Path(__file__).resolve().parents[2]


def _push(
    ctx: zmq.Context, address: str, keys: CurveKeyPair | None, server_key: bytes
) -> zmq.Socket:
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        curve_client(push, keys, server_key)
    push.connect(address)
    return push


def test_forged_stats_never_reach_the_coordinator_nor_its_subscribers() -> None:
    keys, engine_keys, client_keys = (CurveKeyPair.generate() for _ in range(3))
    coordinator = CoordinatorActor("127.0.0.1", None, keys)
    coordinator.admit_engine(0, engine_keys.public)
    coordinator.admit_client(5, client_keys.public)
    ctx = zmq.Context()
    encoder = msgspec.msgpack.Encoder()
    try:
        report_address, publish_address = coordinator.addresses()
        # A rank that looks lost (a stale step counter, a full cache): what forged reports said.
        forged = EngineStatsReport(0, SchedulerStats(num_waiting_reqs=10_000, step_counter=0))
        pushers = [
            _push(ctx, report_address, None, keys.public),  # no CURVE at all
            _push(ctx, report_address, CurveKeyPair.generate(), keys.public),  # an unknown key
        ]
        honest = _push(ctx, report_address, engine_keys, keys.public)
        subscriber = ctx.socket(zmq.SUB)
        curve_client(subscriber, client_keys, keys.public)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(publish_address)
        stranger = ctx.socket(zmq.SUB)  # no key: no snapshot
        stranger.setsockopt(zmq.SUBSCRIBE, b"")
        stranger.connect(publish_address)
        truth = EngineStatsReport(0, SchedulerStats(num_running_reqs=1, step_counter=42))
        deadline = time.monotonic() + 10
        snapshot = None
        decoder = msgspec.msgpack.Decoder(DPStatsSnapshot)
        while time.monotonic() < deadline:
            for pusher in pushers:
                # Once its handshake is refused, a forged pusher has no pipe to queue on.
                with contextlib.suppress(zmq.Again):
                    pusher.send(encoder.encode(forged), zmq.NOBLOCK)
            honest.send(encoder.encode(truth), zmq.NOBLOCK)
            if subscriber.poll(200):
                snapshot = decoder.decode(subscriber.recv())
                if snapshot.reports:
                    break
        assert snapshot is not None and snapshot.reports
        assert [r.stats.step_counter for r in snapshot.reports] == [42]
        assert coordinator.latest_stats()[0]["num_waiting_reqs"] == 0
        assert stranger.poll(500) == 0
    finally:
        coordinator.shutdown()
        ctx.destroy(linger=0)


def test_a_clients_output_socket_takes_no_forged_pushes(engine_checkpoint: str) -> None:
    client_keys = CurveKeyPair.generate()
    engine_keys = EngineKeys(CurveKeyPair.generate(), {0: client_keys.public})
    with running_engine(tiny_config(engine_checkpoint), keys=engine_keys) as served:
        reference = SyncMPClient([served.endpoint], curve_keys=client_keys)
        try:
            expected = _tokens(reference, "r", 30)
        finally:
            reference.shutdown()
        client = SyncMPClient([served.endpoint], curve_keys=client_keys)
        ctx = zmq.Context()
        try:
            client.add_request(request("r", max_tokens=30))
            server_key = client_keys.public
            forgers = [
                _push(ctx, client.output_address, None, server_key),
                _push(ctx, client.output_address, CurveKeyPair.generate(), server_key),
            ]
            finish = EngineCoreOutput("r", [1, 2, 3], finish_reason=FinishReason.STOP)
            for forger in forgers:
                forger.send_multipart([ENGINE_CORE_DEAD, b"0"], zmq.NOBLOCK)
                for frame in MsgpackEncoder().encode(EngineCoreOutputs(0, [finish])):
                    forger.send(frame, zmq.NOBLOCK)
            assert _collect(client, "r") == expected  # every token the engine's, one finish
        finally:
            client.shutdown()
            ctx.destroy(linger=0)


def _tokens(client: SyncMPClient, request_id: str, num_tokens: int) -> list[int]:
    client.add_request(request(request_id, max_tokens=num_tokens))
    return _collect(client, request_id)


def _collect(client: SyncMPClient, request_id: str) -> list[int]:
    tokens: list[int] = []
    while True:
        for output in client.get_output(timeout=20).outputs:
            assert output.request_id == request_id
            tokens += output.new_token_ids
            if output.finished:
                assert output.finish_reason == FinishReason.LENGTH
                return tokens


def test_a_client_without_keys_is_refused_at_once(engine_checkpoint: str) -> None:
    engine_keys = EngineKeys(CurveKeyPair.generate(), {0: CurveKeyPair.generate().public})
    with running_engine(tiny_config(engine_checkpoint), keys=engine_keys) as served:
        start = time.monotonic()
        with pytest.raises(EngineAttachError, match="holds no key"):
            SyncMPClient([served.endpoint])
        assert time.monotonic() - start < 2.0


@pytest.mark.slow
def test_an_engine_started_by_a_client_ends_when_the_client_is_killed(
    engine_checkpoint: str,
) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, multiprocessing, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from shoal import AsyncLLM

        async def main():
            llm = AsyncLLM({engine_checkpoint!r})
            [engine] = multiprocessing.active_children()
            print(engine.pid, flush=True)
            await asyncio.sleep(600)

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert owner.stdout is not None
        engine_pid = int(owner.stdout.readline())
        assert _is_alive(engine_pid)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _is_alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _is_alive(engine_pid), "the engine outlived the process that started it"
    finally:
        owner.kill()


def _is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
