"""`EngineCoreProc`: one rank's engine (`RankEngine`: shoal's `EngineCore` or vLLM's, see
`shoal.engine.core.rank_engine`) behind ZMQ — a busy loop plus two IO threads.

The busy loop runs in whichever thread calls `run_busy_loop()` (a process's main thread, or a
Ray actor's background thread); nothing here assumes the main thread or signals (the process
that hosts one is `shoal.engine.core.engine_process`). The input socket is
`shoal.engine.core.input_socket`, its thread `shoal.engine.core.core_io`, the output thread
`shoal.engine.core.core_output`, the stats schedule `shoal.engine.core.stats_reporter`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from typing import Any

import msgspec
import zmq

from shoal.engine.config import EngineConfig
from shoal.engine.core.connection_gate import MAX_CONNECTIONS
from shoal.engine.core.core_io import UTILITY_METHODS, InputThread, utility_of
from shoal.engine.core.core_output import OutputThread
from shoal.engine.core.curve import (
    EngineKeys,
    client_key_name,
)
from shoal.engine.core.elastic_rank import ElasticRank
from shoal.engine.core.input_socket import InputSocket, Transport
from shoal.engine.core.rank_engine import RankEngine, expert_workers_of, make_rank_engine
from shoal.engine.core.request_ids import scoped, scoped_all, unscope_outputs
from shoal.engine.core.stats_reporter import StatsReporter
from shoal.engine.core.step_watchdog import StepWatchdog
from shoal.engine.core.work_items import (
    AbortRequests,
    AddRequest,
    AttachClient,
    DetachClient,
    EngineDead,
    InputItem,
    MoveStats,
    NotifyClients,
    ReportStats,
    SendOutputs,
    UtilityCall,
    Wake,
)
from shoal.engine.kv_events import with_kv_events
from shoal.engine.model.tp_links import WorkerLauncher
from shoal.engine.parallel.distributed import Rendezvous
from shoal.engine.parallel.dp_wave import PAUSED_POLL_S, DPWave, make_dp_wave
from shoal.engine.parallel.elastic import RECONFIGURED, ScaleNotice, ScalePlan
from shoal.engine.protocol import (
    EEP_NOTIFICATION_CALL_ID,
    EngineCoreOutputs,
    EngineEndpoint,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import tag_structs

logger = logging.getLogger(__name__)

# Idle busy loop: how long to block on the input queue when nothing else is due.
_IDLE_WAIT_S = 1.0
# The exit status of an engine process ended by its step watchdog...
STEP_TIMEOUT_EXIT_CODE = 70
# ...after this long for its death notices to leave.
_DEATH_NOTICE_FLUSH_S = 1.0


class EngineCoreProc:
    """Runs one `RankEngine` with ZMQ IO: a ROUTER for every client's input, a PUSH per client.

    Building it loads the model and binds the input socket; the IO threads start at once, so
    clients may attach before `run_busy_loop()` is called (their work waits for it).

    Wire, client → engine (ROUTER): `[client_routing_id, request_type, *payload]`, the type one
    byte of `EngineCoreRequestType`, the payload `shoal.engine.serial` frames:

        HELLO    EngineHello       → on a new PUSH to its output_address: UtilityOutput(call_id,
                                     result=EngineFacts), or a failure_message (refused)
        ADD      EngineCoreRequest   its client_index is replaced by the HELLO-bound one
        ABORT    list[str]           request ids
        UTILITY  (client_index, call_id, method, args) → UtilityOutput(call_id, result | failure)
        GOODBYE  (no payload)        detaches: the client's requests are aborted

    Engine → client (PUSH per client): one `EngineCoreOutputs` per message, or
    `[ENGINE_CORE_DEAD, b"<engine_index>"]` when the engine stops. A client's connection states
    are documented on `shoal.engine.core.client_table.ClientConnection`.

    Args:
        config: the engine's configuration.
        engine_index: this rank's index.
        host: interface to bind for tcp.
        transport: "tcp" (port chosen by the OS) or "ipc" (a socket file in a temp dir).
        identity: the ROUTER routing id clients use to address this engine; default unique.
        stats_address: where to push `EngineStatsReport`s; None: no reports.
        keys: close the data plane with CURVE (`shoal.engine.core.curve`): the input ROUTER
            admits only the admitted clients' keys (`admit_client`), outputs go only to the
            holder of the client's key, stats only to the coordinator's. None: open sockets
            (tests and benchmarks that compare).
        rendezvous: where the ranks of an expert-parallel cluster meet (required then); the
            ranks step in DP waves (`shoal.engine.parallel.dp_wave`).
        joining: the resize this rank was started for (a scale-up of an expert-parallel
            cluster): it joins the new set's groups when its busy loop starts, as the old
            ranks switch, instead of in the constructor. Resizes: `elastic`
            (`shoal.engine.core.elastic_rank`).
        max_connections: past this many connections to the input socket, a handshake is
            refused unless it proves a cluster key (`shoal.engine.core.connection_gate`).
        worker_launcher: starts a tensor-parallel rank's other workers (`EngineCore`).

    The engine is the one `config.rank_engine.engine` names (`make_rank_engine`).

    Raises:
        ModelLoadError, ValueError: from the engine.
        GroupJoinError: an expert-parallel peer did not join in time.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_index: int = 0,
        host: str = "127.0.0.1",
        transport: Transport = "tcp",
        identity: bytes | None = None,
        stats_address: str | None = None,
        rendezvous: Rendezvous | None = None,
        keys: EngineKeys | None = None,
        joining: ScalePlan | None = None,
        max_connections: int = MAX_CONNECTIONS,
        worker_launcher: WorkerLauncher | None = None,
    ) -> None:
        self.engine_index = engine_index
        self.engine_core: RankEngine = make_rank_engine(
            config, engine_index=engine_index, worker_launcher=worker_launcher
        )
        self._wave = make_dp_wave(
            expert_workers_of(self.engine_core),
            rendezvous,
            timeout_s=config.parallel.collective_timeout_s,
            join=joining is None,
        )
        self._joining = joining
        self._identity = identity or f"engine-{engine_index}-{uuid.uuid4().hex[:8]}".encode()
        self._input_queue: queue.SimpleQueue[InputItem] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._keys = keys
        self._socket = InputSocket(self._ctx, engine_index, host, transport, keys, max_connections)
        self._client_keys = self._socket.client_keys
        self._input_address = self._socket.address
        # Clients to detach: the output thread's (they did not take their outputs in time)
        # and revoked ones.
        self._lagging: queue.SimpleQueue[tuple[int, int | None]] = queue.SimpleQueue()
        self._input_thread = self._make_input_thread()
        self._output_thread = OutputThread.for_engine(
            engine_index, self._ctx, stats_address, self._lagging, keys
        )
        self._is_stats_enabled = stats_address is not None
        self._stats = StatsReporter(engine_index, self._identity)
        self._init_client_state()
        self._lock = threading.Lock()
        self._is_shutdown_requested = False
        self._is_running = False
        self._is_closed = False
        step_timeout_s = config.scheduler.step_timeout_s
        self._watchdog = (
            StepWatchdog(step_timeout_s, self._on_step_timeout) if step_timeout_s > 0 else None
        )
        # The local path: a Hub id became its snapshot folder in the engine.
        self.elastic = self._make_elastic_rank(self.engine_core.config.model.model, joining)
        self._input_thread.start()
        self._output_thread.start()

    def _make_input_thread(self) -> InputThread:
        keys = self._keys
        return InputThread(
            self._ctx,
            self._socket.router,
            self.engine_core.facts(self._identity),
            UTILITY_METHODS,
            self._input_queue,
            lagging_clients=self._lagging,
            keys=keys.engine if keys is not None else None,
            client_keys=self._client_keys,
        )

    def _init_client_state(self) -> None:
        """What the busy loop keeps about its clients."""
        # Requests aborted because their client left: dropped from the next step's outputs so
        # the client, should it attach again, never sees them.
        self._orphan_ids: dict[int, set[str]] = {}
        # Attached clients as the stats reports tell them (see `EngineStatsReport`).
        self._attached_clients: set[int] = set()
        self._kv_event_clients: set[int] = set()  # those that asked for KV events at HELLO
        # The last resize this rank committed: told again to every client that attaches later.
        self._last_reconfigured: ScaleNotice | None = None
        self._attaches_seen = 0

    def _make_elastic_rank(self, model_path: str, joining: ScalePlan | None) -> ElasticRank:
        return ElasticRank(
            self.engine_core,
            self._wave,
            model_path=model_path,
            notify=self._notify,
            drop_outputs=lambda client, ids: self._orphan_ids.setdefault(client, set()).update(ids),
            attached_clients=lambda: tuple(self._attached_clients),
            wake=lambda: self._input_queue.put(Wake()),
            joining=joining,
        )

    @property
    def input_address(self) -> str:
        return self._input_address

    @property
    def identity(self) -> bytes:
        return self._identity

    @property
    def endpoint(self) -> EngineEndpoint:
        public_key = self._keys.engine.public if self._keys is not None else b""
        return EngineEndpoint(
            self.engine_index, self._identity, self._input_address, public_key=public_key
        )

    def admit_client(self, client_index: int, public_key: bytes) -> None:
        """Admits a client's public key: it may connect and attach as `client_index` from now
        on (a key admitted before for that index is replaced). Thread-safe.

        Raises:
            RuntimeError: this engine runs without CURVE.
            ValueError: not a CURVE public key.
        """
        if self._client_keys is None:
            raise RuntimeError("this engine runs without CURVE; it has no keys to admit")
        self._client_keys.admit(client_key_name(client_index), public_key)

    def revoke_client(self, client_index: int) -> None:
        """Takes a client's key out and detaches the client if it is attached. Thread-safe."""
        if self._client_keys is not None:
            self._client_keys.revoke(client_key_name(client_index))
            self._lagging.put((client_index, None))

    # --- the busy loop ----------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Serves until `shutdown()`; blocks the calling thread.

        Each turn: (1) drain the input queue, blocking briefly when idle; (2) if there is work,
        run one engine step, watched by the step watchdog; (3) send each client's outputs (from this thread when the output
        thread is idle, else through it); (4) report stats when due. On a fatal error every
        attached client is told ENGINE_CORE_DEAD.

        Raises:
            Exception: whatever killed the loop, after the clients were told.
        """
        with self._lock:
            if self._is_closed:
                raise RuntimeError("this EngineCoreProc was shut down")
            self._is_running = True
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.start()
        try:
            if self._joining is not None:
                self.elastic.join_new_set()
            while not self._is_shutdown_requested:
                self._process_input_queue()  # (1)
                if self.engine_core.has_kv_events():  # a change outside a step (a reset)
                    self._queue_outputs({})
                self.elastic.poll()
                if self._wave is not None:
                    self._run_wave_turn(self._wave)  # (2), (3) in lockstep with the peers
                elif self.engine_core.has_unfinished_requests():
                    if watchdog is not None:
                        watchdog.step_started()
                    outputs = self.engine_core.step()
                    if watchdog is not None:
                        watchdog.step_finished()
                    self._queue_outputs(outputs)  # (2), (3)
                    self._stats.is_dirty = True
                if self._is_stats_enabled:
                    self._maybe_report_stats()  # (4)
        except Exception:
            logger.exception("engine %d busy loop died", self.engine_index)
            raise
        finally:
            self._close()

    def _run_wave_turn(self, wave: DPWave) -> None:
        """One turn under DP waves: start or join a wave, then one forward (real or dummy);
        a switch, when the ranks agree on one."""
        core = self.engine_core
        elastic = self.elastic
        if wave.has_left:  # out of the set: released requests' ends are dropped here
            if core.has_unfinished_requests():
                self._queue_outputs(core.step())
            return
        wave.maybe_start(core.has_unfinished_requests(), elastic.ready_epoch())
        if not wave.is_running:
            elastic.after_turn()
            return
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.step_started()
        num_forwards = wave.experts.num_forwards
        outputs = core.step()
        if wave.experts.num_forwards == num_forwards:
            wave.run_dummy_forward()
        wave.end_turn(core.has_unfinished_requests(), elastic.ready_epoch())
        if watchdog is not None:
            watchdog.step_finished()
        self._queue_outputs(outputs)
        self._stats.is_dirty = True
        elastic.after_turn()

    def _process_input_queue(self) -> None:
        input_queue = self._input_queue
        is_wave_running = self._wave is not None and self._wave.is_running
        if not (self.engine_core.has_unfinished_requests() or is_wave_running):
            try:
                self._handle_input(input_queue.get(timeout=self._idle_wait_s()))
            except queue.Empty:
                return
        while not input_queue.empty():
            self._handle_input(input_queue.get_nowait())

    def _idle_wait_s(self) -> float:
        if self._wave is not None:  # a paused rank looks for a wake this often
            return PAUSED_POLL_S
        if not self._is_stats_enabled:
            return _IDLE_WAIT_S
        return self._stats.wait_s()

    def _handle_input(self, item: InputItem) -> None:
        self._stats.is_dirty = True
        match item:
            case AddRequest(request):
                request.request_id = scoped(request.client_index, request.request_id)
                if self.elastic.release_new_request(request):
                    return
                if self._wave is not None:
                    self._wave.note_request(request.current_wave)
                self.engine_core.add_request(request)
            case AbortRequests(request_ids, client_index):
                ids = scoped_all(client_index, request_ids)
                self.engine_core.abort_requests(ids, client_index=client_index)
            case UtilityCall(client_index, call_id, method, args):
                self._call_utility(client_index, call_id, method, args)
            case DetachClient(client_index):
                self._attached_clients.discard(client_index)
                self._kv_event_clients.discard(client_index)
                aborted = self.engine_core.abort_client_requests(client_index)
                if aborted:
                    self._orphan_ids[client_index] = set(aborted)
                self._output_thread.submit(item)
            case AttachClient(client_index, attach_serial=attach_serial):
                self._attached_clients.add(client_index)
                if item.wants_kv_events:
                    self._kv_event_clients.add(client_index)
                else:
                    self._kv_event_clients.discard(client_index)
                self._attaches_seen = attach_serial
                self._output_thread.submit(item)
                if self._last_reconfigured is not None:  # the set this client attached to
                    self._notify(client_index, RECONFIGURED, self._last_reconfigured)
            case SendOutputs() | MoveStats():
                self._output_thread.submit(item)
            case NotifyClients(kind, notice):
                if kind == RECONFIGURED:
                    self._last_reconfigured = notice
                for client_index in sorted(self._attached_clients):
                    self._notify(client_index, kind, notice)
            case EngineDead():
                raise RuntimeError("an engine IO thread failed")
            case Wake():
                pass

    def _call_utility(self, client_index: int, call_id: int, method: str, args: list[Any]) -> None:
        try:
            value = utility_of(self.engine_core, method)(*args)
            output = UtilityOutput(call_id=call_id, result=UtilityResult(tag_structs(value)))
        except Exception as e:
            logger.info("utility call %s failed: %s", method, e)
            output = UtilityOutput(call_id=call_id, failure_message=f"{type(e).__name__}: {e}")
        outputs = EngineCoreOutputs(engine_index=self.engine_index, utility_output=output)
        self._output_thread.send_or_submit(client_index, outputs)

    def notify_clients(self, kind: str, notice: ScaleNotice) -> None:
        """Sends an elastic notification to every attached client (from the busy loop, after
        every output queued before it); thread-safe."""
        self._input_queue.put(NotifyClients(kind, notice))

    def _notify(self, client_index: int, kind: str, notice: ScaleNotice) -> None:
        result = UtilityResult([kind, msgspec.to_builtins(notice)])
        output = UtilityOutput(call_id=EEP_NOTIFICATION_CALL_ID, result=result)
        outputs = EngineCoreOutputs(engine_index=self.engine_index, utility_output=output)
        self._output_thread.send_or_submit(client_index, outputs)

    def _queue_outputs(self, outputs_by_client: dict[int, EngineCoreOutputs]) -> None:
        orphans, self._orphan_ids = self._orphan_ids, {}
        batches = self.engine_core.take_kv_events()
        frames = with_kv_events(
            outputs_by_client, batches, self._kv_event_clients, self.engine_index
        )
        for client_index, outputs in frames:
            dropped = orphans.get(client_index)
            if dropped:
                outputs.outputs = [o for o in outputs.outputs if o.request_id not in dropped]
            unscope_outputs(client_index, outputs.outputs)  # `request_ids`
            self._output_thread.send_or_submit(client_index, outputs)

    def _maybe_report_stats(self) -> None:
        report = self._stats.report(
            self.engine_core, self._wave, self._attached_clients, self._attaches_seen
        )
        if report is not None:
            self._output_thread.submit(ReportStats(report))

    def set_stats_address(self, address: str) -> None:
        """Pushes stats reports to `address` from now on (the coordinator moved); thread-safe.

        Ignored by an engine started without a stats address.
        """
        if self._is_stats_enabled:
            self._input_queue.put(MoveStats(address))

    # --- shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops the busy loop (or, if it never ran, the IO threads); thread-safe, idempotent."""
        with self._lock:
            self._is_shutdown_requested = True
            is_running = self._is_running
        if is_running:
            self._input_queue.put(Wake())
        else:
            self._close()

    def _on_step_timeout(self, running_s: float) -> None:
        """The watchdog's verdict on a step that never returned: tell the clients, then end the
        process, the only way to stop the stuck thread; its host restarts the engine."""
        logger.error(
            "engine %d: a step has run for %.1f s (step_timeout_s=%s); ending the process",
            self.engine_index,
            running_s,
            self.engine_core.config.scheduler.step_timeout_s,
        )
        self._output_thread.submit(EngineDead())
        self._output_thread.join(timeout=2)
        # The context's IO thread sends the notices in the background, after the output
        # thread has closed its sockets; an exit now would cut them off.
        time.sleep(_DEATH_NOTICE_FLUSH_S)
        logging.shutdown()
        os._exit(STEP_TIMEOUT_EXIT_CODE)

    def _close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._wave is not None:  # first: peers blocked in a collective with us fail now
            self._wave.abandon()
        self._input_thread.stop()
        self._input_thread.join(timeout=5)
        # Clients attached after the loop's last turn still get their PUSH and the notice.
        while not self._input_queue.empty():
            item = self._input_queue.get_nowait()
            if isinstance(item, AttachClient):
                self._output_thread.submit(item)
        # Attached clients learn at once that this engine is gone, fatal error or not.
        self._output_thread.submit(EngineDead())
        self._output_thread.join(timeout=5)
        try:
            self.engine_core.shutdown()
        finally:
            if self._input_thread.is_alive() or self._output_thread.is_alive():
                logger.warning("engine %d IO threads did not stop", self.engine_index)
            elif not self._socket.stop_handler():
                logger.warning("engine %d ZAP handler did not stop", self.engine_index)
            else:
                self._ctx.destroy(linger=0)  # sockets still open belong to no live thread
            self._socket.remove_files()
