"""Clients of an engine core: in-process (tests, offline API) and a worker process over ZeroMQ.

The worker runs the busy loop: take every queued message, run a step while there is work, send the
outputs, and block on the socket when idle. The frontend talks to it with typed msgspec messages
(protocol.py) over two ipc sockets: PUSH requests in, PULL outputs back.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from hybridserve.config import EngineConfig
from hybridserve.engine.protocol import (
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailed,
    EngineInput,
    EngineMessage,
    EngineReady,
    Shutdown,
)

logger = logging.getLogger("hybridserve.engine")

STARTUP_TIMEOUT_S = 600.0
_IDLE_POLL_MS = 1000
_LIVENESS_POLL_MS = 1000
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, however the parent ends (even SIGKILL)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def connect_worker(in_addr: str, out_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A worker process's end of its two pipes to the frontend: (inbox it pulls from, outbox it pushes to)."""
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    return inbox, outbox


def run_engine_worker(config: EngineConfig, hf_dir: Path, in_addr: str, out_addr: str) -> None:
    """Entry point of the worker process. It never outlives the frontend that started it."""
    from hybridserve.engine.core import EngineCore

    parent = os.getppid()
    _die_with_parent()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    inbox, outbox = connect_worker(in_addr, out_addr)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(EngineInput).decode
    try:
        core = EngineCore(config, hf_dir)
    except Exception as exc:
        logger.exception("engine start-up failed")
        outbox.send(encode(EngineFailed(f"{type(exc).__name__}: {exc}")))
        return
    runner = core.runner
    outbox.send(encode(EngineReady(core.max_model_len, runner.vocab_size, runner.num_blocks, config.block_size)))
    while True:
        if os.getppid() != parent:  # orphaned (where the kernel hook is missing): nobody reads our outputs
            logger.error("engine worker: frontend process %d is gone; exiting", parent)
            return
        if not core.has_work():
            inbox.poll(_IDLE_POLL_MS)
        while inbox.poll(0):
            msg = decode(inbox.recv())
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AddRequest):
                core.add_request(msg.request)
            else:
                core.abort(msg.request_ids)
        try:
            outputs = core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            outputs = EngineCoreOutputs(core.fail_all(f"engine step failed: {type(exc).__name__}: {exc}"))
        outbox.send(encode(outputs))


class ProcessEngineClient:
    """Starts a worker process and exchanges messages with it from an asyncio event loop."""

    def __init__(self, config: EngineConfig, hf_dir: Path) -> None:
        base = Path(tempfile.gettempdir()) / f"hybridserve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._in_addr, self._out_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        # Sends are synchronous (a PUSH below its high-water mark never blocks), so an abort issued while
        # a caller is being cancelled cannot itself be cancelled; receiving is asyncio.
        self._sync_ctx = zmq.Context()
        self._to_engine = self._sync_ctx.socket(zmq.PUSH)
        self._to_engine.bind(self._in_addr)
        self._ctx = zmq.asyncio.Context()
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(self._out_addr)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(EngineMessage).decode
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_worker,
            args=(config, hf_dir, self._in_addr, self._out_addr),
            name="hybridserve-engine",
            daemon=True,
        )
        self.process.start()
        self.ready = self._wait_ready()

    def _wait_ready(self) -> EngineReady:
        """Block (before any event loop runs) until the worker reports it loaded, or died."""
        sync = zmq.Socket.shadow(self._from_engine.underlying)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if sync.poll(1000):
                msg = self._decode(sync.recv())
                if isinstance(msg, EngineFailed):
                    raise RuntimeError(f"engine worker failed to start: {msg.error}")
                if isinstance(msg, EngineReady):
                    return msg
            if not self.process.is_alive():
                raise RuntimeError(f"engine worker exited during start-up (exit code {self.process.exitcode})")
        raise RuntimeError(f"engine worker did not start within {STARTUP_TIMEOUT_S:.0f}s")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._to_engine.send(self._encode(AddRequest(request)))

    def abort(self, request_ids: list[str]) -> None:
        self._to_engine.send(self._encode(AbortRequests(request_ids)))

    async def get_outputs(self) -> EngineCoreOutputs:
        """The worker's next batch of outputs. Raises once the worker process has died, so nobody waits on
        a dead engine: the socket is polled with a timeout and the process checked in between."""
        while not await self._from_engine.poll(_LIVENESS_POLL_MS):
            if not self.process.is_alive():
                raise RuntimeError(f"engine worker process exited (exit code {self.process.exitcode})")
        msg = self._decode(await self._from_engine.recv())
        if isinstance(msg, EngineFailed):
            raise RuntimeError(f"engine worker failed: {msg.error}")
        if not isinstance(msg, EngineCoreOutputs):
            raise RuntimeError(f"unexpected engine message {type(msg).__name__}")
        return msg

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self) -> None:
        if self.process.is_alive():
            self._to_engine.send(self._encode(Shutdown()))
            self.process.join(timeout=5)
            if self.process.is_alive():  # busy or stuck: it holds nothing that must be saved
                self.process.kill()
                self.process.join(timeout=5)
        self._ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
        for addr in (self._in_addr, self._out_addr):
            Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)
