"""One worker as the router sees it: its address, its state, the session with it, and the requests it holds.

A session is a ZeroMQ DEALER socket (a fresh one, with a fresh session id, on every connect) opened with
`Hello` and answered with the worker's identity. Liveness is ZeroMQ's own transport heartbeat (ZMTP PING/PONG,
answered by the worker's I/O thread, so an engine step of any length does not silence it): a killed, stopped
or unreachable worker drops the connection after the heartbeat timeout, and the socket's monitor says so. The
link's state moves
connecting → up → down → connecting … (or → refused, when the worker is the wrong one or refuses us); the
router owns the transitions. A local worker (spawned by this frontend) also has its process, which is
restarted when it dies.
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from urllib.parse import urlsplit, urlunsplit

import msgspec
import zmq
import zmq.asyncio

from hybridserve.engine.cache.events import KVEventBatch
from hybridserve.engine.kv_transfer.messages import TransferEndpoint
from hybridserve.engine.protocol import (
    EngineInput,
    Hello,
    Refused,
    SchedulerStats,
    Welcome,
    WorkerIdentity,
    WorkerOutput,
    protocol_fingerprint,
)


class WorkerState(enum.StrEnum):
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"  # it died, hung or dropped the session; retried with backoff
    REFUSED = "refused"  # it is not the worker this deployment needs, or it refused us; retried with backoff


class HandshakeRefused(RuntimeError):
    pass


class WorkerExited(RuntimeError):
    """A local worker's process ended before it answered."""


_POLL_MS = 200
_HEARTBEAT_IVL_MS = 1000  # a ZMTP PING this often; the link's heartbeat timeout ends a connection it goes unanswered


@dataclass
class WorkerLink:
    name: str
    address: str
    role: str = "both"  # what the deployment uses it for: both, prefill or decode
    process: BaseProcess | None = None  # a local worker's process
    state: WorkerState = WorkerState.CONNECTING
    error: str | None = None  # why it is down or refused
    identity: WorkerIdentity | None = None
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    requests: dict[str, int] = field(default_factory=dict)  # request id → tokens it holds (its load)
    load_tokens: int = 0  # the sum over `requests`, kept as they change: routing reads it for every request
    last_heard: float = 0.0
    failures: int = 0  # consecutive failed connects or losses, for the backoff
    restarts: int = 0  # times a local worker's process was started again
    start_failures: int = 0  # consecutive starts of a local worker's process that ended before it answered
    retry_at: float = 0.0
    routed_hits: int = 0  # requests routed here that matched at least one cached block
    routed_misses: int = 0
    matched_blocks: int = 0
    transfer: TransferEndpoint | None = None  # a prefill or decode worker's, from its Welcome
    introduced: set[str] = field(default_factory=set)  # decode worker: prefill agents it was told of, this session
    sock: zmq.asyncio.Socket | None = None
    events: zmq.asyncio.Socket | None = None
    monitor: zmq.asyncio.Socket | None = None  # the session socket's disconnect events

    def hold(self, request_id: str, tokens: int) -> None:
        self.requests[request_id] = tokens
        self.load_tokens += tokens

    def grow(self, request_id: str, tokens: int) -> None:
        self.requests[request_id] += tokens
        self.load_tokens += tokens

    def release(self, request_id: str) -> None:
        self.load_tokens -= self.requests.pop(request_id)

    def release_all(self) -> None:
        self.requests.clear()
        self.load_tokens = 0

    def send(self, msg: EngineInput) -> None:
        if self.sock is not None:
            self.sock.send(_encode(msg), flags=zmq.NOBLOCK)

    async def connect(
        self, ctx: zmq.asyncio.Context, frontend: str, secret: str, timeout_s: float, heartbeat_timeout_s: float
    ) -> Welcome:
        """Opens a new session; raises HandshakeRefused when the worker says no, TimeoutError when it is silent,
        WorkerExited when a local worker's process ends first."""
        self.close()
        self.introduced.clear()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # a send never fails for a full queue: the worker drains it
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(_HEARTBEAT_IVL_MS, round(heartbeat_timeout_s * 1000)))
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self.sock = sock
        sock.send(_encode(Hello(frontend, uuid.uuid4().hex, secret, protocol_fingerprint())))
        deadline = time.monotonic() + timeout_s
        while not await sock.poll(_POLL_MS):
            if self.process is not None and not self.process.is_alive():
                self.close()
                raise WorkerExited(f"its process exited during start-up (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"no answer within {timeout_s:g}s")
        reply = _decode(await sock.recv())
        if isinstance(reply, Refused):
            self.close()
            raise HandshakeRefused(reply.error)
        if not isinstance(reply, Welcome):
            self.close()
            raise HandshakeRefused(f"expected Welcome, got {type(reply).__name__}")
        self.last_heard = time.monotonic()
        return reply

    def subscribe(self, ctx: zmq.asyncio.Context, events_address: str) -> None:
        events = ctx.socket(zmq.SUB)
        events.setsockopt(zmq.LINGER, 0)
        events.setsockopt(zmq.SUBSCRIBE, b"")
        events.connect(_events_address(self.address, events_address))
        self.events = events

    async def recv(self) -> WorkerOutput:
        assert self.sock is not None
        return _decode(await self.sock.recv())

    async def recv_events(self) -> KVEventBatch:
        assert self.events is not None
        return _decode_events(await self.events.recv())

    async def disconnected(self) -> None:
        """Returns when the session's connection drops: the worker died, stopped or became unreachable long
        enough to miss the transport heartbeats."""
        assert self.monitor is not None
        await self.monitor.recv_multipart()

    def close(self) -> None:
        if self.sock is not None and self.monitor is not None:
            self.sock.disable_monitor()
        for sock in (self.monitor, self.sock, self.events):
            if sock is not None:
                sock.close(linger=0)
        self.sock = self.events = self.monitor = None


def _events_address(worker_address: str, announced: str) -> str:
    """For tcp, the announced port on the host this frontend reached the worker at (it may have bound 0.0.0.0)."""
    worker, events = urlsplit(worker_address), urlsplit(announced)
    if worker.scheme != "tcp" or worker.hostname is None:
        return announced
    host = f"[{worker.hostname}]" if ":" in worker.hostname else worker.hostname
    return urlunsplit(("tcp", f"{host}:{events.port}", "", "", ""))


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(WorkerOutput).decode
_decode_events = msgspec.msgpack.Decoder(KVEventBatch).decode
