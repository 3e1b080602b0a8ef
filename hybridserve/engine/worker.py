"""An engine worker: the engine core behind a ZeroMQ ROUTER socket, serving the frontends that connect to it.

`hybridserve worker` runs one standalone (tcp, usually on another host); `hybridserve serve` spawns its local
ones (ipc) through the process helper. Either way the loop is the same: take every queued message, run a step
while there is work, send each frontend the outputs of its own requests, publish what the prefix cache gained
and lost (KV events, on a PUB socket, numbered per batch), and block on the socket when idle.

A frontend opens a session with `Hello` (carrying the shared secret, when the worker has one) and keeps it
alive with pings; the worker answers with its identity (`Welcome`). A session that goes silent for longer than
the session timeout, or that the same frontend replaces with a new one (it restarted, or gave up on this
worker and came back), has its requests aborted, so no work runs for a reader that is gone.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import zmq

from hybridserve.config import EngineConfig
from hybridserve.engine.cache.events import KVEventBatch, KVEventLog
from hybridserve.engine.identity import tokenizer_fingerprint, weights_fingerprint
from hybridserve.engine.protocol import (
    AbortRequests,
    AddRequest,
    AddTransferPeer,
    CheckIntegrity,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineFacts,
    EngineInput,
    FinishReason,
    GetCachedSet,
    Hello,
    IntegrityReport,
    Ping,
    Pong,
    Refused,
    Welcome,
    WorkerIdentity,
    protocol_fingerprint,
)
from hybridserve.process import ChildEnd, freeze_startup_heap

logger = logging.getLogger("hybridserve.worker")

SESSION_TIMEOUT_S = 30.0  # a frontend pings every second; this much silence ends its session
_IDLE_POLL_MS = 1000
_TRANSFER_POLL_MS = 20  # idle, but holding prefilled requests or reading: how often to look at them


def check_listen_address(listen: str, secret: str) -> None:
    """A worker runs whatever token ids it is sent: off loopback it needs a shared secret. Raises ValueError."""
    parts = urlsplit(listen)
    if parts.scheme == "ipc":
        return
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"--listen must look like tcp://HOST:PORT or ipc:///path, got {listen!r}")
    host = parts.hostname
    loopback = host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)
    if not loopback and not secret:
        raise ValueError(
            f"--listen {listen} is not a loopback address: give the worker a shared secret (--api-key or "
            "$HYBRIDSERVE_WORKER_API_KEY) that its frontends send"
        )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def worker_identity(
    model_name: str, hf_dir: Path, dtype: str, recurrent_state: bool, facts: EngineFacts
) -> WorkerIdentity:
    return WorkerIdentity(
        model_name, weights_fingerprint(hf_dir), tokenizer_fingerprint(hf_dir), dtype, recurrent_state, facts
    )


@dataclass
class _Session:
    frontend: str
    session: str
    last_heard: float
    requests: set[str] = field(default_factory=set)


class EngineWorker:
    """Serves one loaded engine core on `listen` until `stop()` (SIGTERM) or `stop_when()` turns true."""

    def __init__(
        self,
        config: EngineConfig,
        hf_dir: Path,
        model_name: str,
        listen: str,
        secret: str = "",
        stop_when: Callable[[], bool] = lambda: False,
        session_timeout_s: float = SESSION_TIMEOUT_S,
    ) -> None:
        from hybridserve.engine.client import engine_facts
        from hybridserve.engine.core import EngineCore  # heavy (torch)

        self.events = KVEventLog()
        self.core = EngineCore(config, hf_dir, self.events)
        runner = self.core.runner
        dtype = str(runner.dtype).removeprefix("torch.")
        facts = engine_facts(self.core, config)
        self.identity = worker_identity(model_name, hf_dir, dtype, runner.num_state_slots > 0, facts)
        self.role = config.transfer.role
        self.secret = secret
        self.stop_when = stop_when
        self.session_timeout_s = session_timeout_s
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.bind(listen)
        self.listen = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pub = self._ctx.socket(zmq.PUB)
        self.events_address = self._bind_events(listen)
        self.sessions: dict[bytes, _Session] = {}
        self.owner: dict[str, bytes] = {}  # request id → the session that sent it
        self.seq = 0  # KV event batches published
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(EngineInput).decode
        self._stopping = False

    def _bind_events(self, listen: str) -> str:
        parts = urlsplit(listen)
        if parts.scheme == "ipc":
            address = f"{listen}-kv"
            self.pub.bind(address)
            return address
        port = self.pub.bind_to_random_port(f"tcp://{parts.hostname}")
        return f"tcp://{parts.hostname}:{port}"

    def stop(self, *_: object) -> None:
        self._stopping = True

    def serve(self) -> None:
        freeze_startup_heap("engine worker")
        logger.info("engine worker ready (%s): serving %s at %s", self.role, self.identity.model, self.listen)
        try:
            while not self._stopping and not self.stop_when():
                if not self.core.has_work():
                    self.sock.poll(_TRANSFER_POLL_MS if self.core.watching_transfers else _IDLE_POLL_MS)
                while self.sock.poll(0):
                    self._handle(*self.sock.recv_multipart())
                self._expire_sessions()
                if self.core.has_work() or self.core.watching_transfers:
                    self._step()
        finally:
            self.sock.close(linger=0)
            self.pub.close(linger=0)
            self._ctx.term()

    def _send(self, route: bytes, msg: msgspec.Struct) -> None:
        self.sock.send_multipart([route, self._encode(msg)])

    def _handle(self, route: bytes, raw: bytes) -> None:
        """One message from a frontend."""
        try:
            msg = self._decode(raw)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            self._reject_undecodable(route, raw, exc)
            return
        if isinstance(msg, Hello):
            self._hello(route, msg)
            return
        session = self.sessions.get(route)
        if session is None:
            self._send(route, Refused("no session: send Hello first (the worker restarted or ended the session)"))
            return
        session.last_heard = time.monotonic()
        if isinstance(msg, AddRequest):
            self._add(route, session, msg)
        elif isinstance(msg, AbortRequests):
            # A held request (prefilled for a decode worker) is no session's any more: its frontend may drop it.
            held = self.core.held_for_readers
            self.core.abort([rid for rid in msg.request_ids if self.owner.get(rid) == route or rid in held])
        elif isinstance(msg, Ping):
            self._send(route, Pong(self.core.stats()))
        elif isinstance(msg, GetCachedSet):
            self._send(route, self.core.kv.cached_set(self.seq))
        elif isinstance(msg, AddTransferPeer):
            self.core.add_transfer_peer(msg.endpoint)
        elif isinstance(msg, CheckIntegrity):
            self._send(route, IntegrityReport(self._integrity(), self.core.stats()))

    def _integrity(self) -> str | None:
        try:
            self.core.check_integrity()
        except AssertionError as exc:
            return str(exc)
        return None

    def _hello(self, route: bytes, hello: Hello) -> None:
        if self.secret and not hmac.compare_digest(hello.secret.encode(), self.secret.encode()):
            logger.warning("refused a frontend session: wrong shared secret")
            self._send(route, Refused("wrong shared secret (the worker's --api-key)"))
            return
        if hello.protocol != protocol_fingerprint():
            theirs = hello.protocol or "none"
            logger.warning("refused frontend %s: its protocol %s is not this worker's", hello.frontend, theirs)
            why = f"protocol {theirs} != {protocol_fingerprint()} (the frontend's and this worker's hybridserve differ)"
            self._send(route, Refused(why))
            return
        for old_route, old in list(self.sessions.items()):
            if old.frontend == hello.frontend or old_route == route:
                self._end_session(old_route, "replaced by a new session of its frontend")
        self.sessions[route] = _Session(hello.frontend, hello.session, time.monotonic())
        connector = self.core.connector
        endpoint = connector.endpoint if connector is not None else None
        self._send(route, Welcome(self.identity, self.events_address, self.role, endpoint))

    def _add(self, route: bytes, session: _Session, msg: AddRequest) -> None:
        request = msg.request
        self.owner[request.request_id] = route
        session.requests.add(request.request_id)
        try:
            self.core.add_request(request)
        except Exception as exc:  # that request's error, nobody else's
            logger.exception("request %s could not be added", request.request_id)
            self._finish_undeliverable(request.request_id, f"the engine could not take the request: {exc}")

    def _reject_undecodable(self, route: bytes, raw: bytes, exc: Exception) -> None:
        """A message that does not decode: if it names a request, that request fails; nothing else changes."""
        logger.warning("undecodable message from a frontend: %s", exc)
        try:
            tag, request = msgspec.msgpack.decode(raw)
            request_id = request[0] if tag == "AddRequest" else None
        except Exception:
            request_id = None
        if isinstance(request_id, str) and route in self.sessions:
            error = f"the worker could not decode the request: {exc}"
            self._send(route, EngineCoreOutputs([_error_output(request_id, error)]))

    def _finish_undeliverable(self, request_id: str, error: str) -> None:
        route = self.owner.pop(request_id)
        self.sessions[route].requests.discard(request_id)
        self._send(route, EngineCoreOutputs([_error_output(request_id, error)]))

    def _end_session(self, route: bytes, why: str) -> None:
        session = self.sessions.pop(route)
        if session.requests:
            logger.warning("frontend %s: %s; aborting its %d requests", session.frontend, why, len(session.requests))
        self.core.abort(sorted(session.requests))
        for rid in session.requests:
            self.owner.pop(rid, None)

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        for route, session in list(self.sessions.items()):
            if now - session.last_heard > self.session_timeout_s:
                self._end_session(route, f"silent for more than {self.session_timeout_s:g}s")

    def _step(self) -> None:
        try:
            batch = self.core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            batch = EngineCoreOutputs(self.core.fail_all(f"engine step failed: {type(exc).__name__}: {exc}"))
        by_route: dict[bytes, list[EngineCoreOutput]] = {}
        for out in batch.outputs:
            route = self.owner.get(out.request_id)
            if route is None:
                continue  # its session ended
            by_route.setdefault(route, []).append(out)
            if out.finish_reason is not None or out.kv_transfer is not None:  # over, or now the decode worker's
                del self.owner[out.request_id]
                self.sessions[route].requests.discard(out.request_id)
        for route, outputs in by_route.items():
            self._send(route, EngineCoreOutputs(outputs, batch.stats))
        events = self.events.drain()
        if events:
            self.seq += 1
            self.pub.send(self._encode(KVEventBatch(self.seq, events)))


def _error_output(request_id: str, error: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=error)


def run_local_worker(config: EngineConfig, hf_dir: Path, model_name: str, listen: str) -> None:
    """Entry point of a worker process `serve` spawned: it dies with its parent and stops on SIGTERM."""
    child = ChildEnd()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    worker = EngineWorker(config, hf_dir, model_name, listen, stop_when=child.orphaned)
    signal.signal(signal.SIGTERM, worker.stop)
    worker.serve()


def run_standalone_worker(config: EngineConfig, hf_dir: Path, model_name: str, listen: str, secret: str) -> None:
    """`hybridserve worker`: serves until SIGTERM or SIGINT."""
    worker = EngineWorker(config, hf_dir, model_name, listen, secret)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    worker.serve()
