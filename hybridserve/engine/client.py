"""Clients of an engine core: the `EngineClient` protocol, in-process and in a worker process over ZeroMQ.

Everything above the protocol (AsyncLLM, the serving layer) works with any implementation and never knows
which one it has: the engine core in this process (tests, the offline API), one worker process, or (later)
a router over several workers.

The worker runs the busy loop: take every queued message, run a step while there is work, send the
outputs, and block on the socket when idle. The frontend talks to it with typed msgspec messages
(protocol.py) over two ipc sockets: PUSH requests in, PULL outputs back.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from hybridserve.config import EngineConfig
from hybridserve.engine.protocol import (
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    EngineInput,
    SchedulerStats,
    Shutdown,
)
from hybridserve.process import ChildEnd, ChildProcesses

if TYPE_CHECKING:
    from hybridserve.engine.core import EngineCore

logger = logging.getLogger("hybridserve.engine")

STARTUP_TIMEOUT_S = 600.0
_IDLE_POLL_MS = 1000
_LIVENESS_POLL_MS = 1000
_WORKER_NAME = "hybridserve-engine"


class EngineClient(Protocol):
    """The token-level engine as the frontend sees it."""

    @property
    def facts(self) -> EngineFacts:
        """The loaded engine's limits (context length, vocabulary, KV blocks)."""
        ...

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort(self, request_ids: list[str]) -> None:
        """Stop the engine's work on these requests; unknown or finished ids are ignored."""
        ...

    async def get_outputs(self) -> EngineCoreOutputs:
        """The next batch of outputs (waits while there is none). Raises once the engine cannot serve."""
        ...

    def stats(self) -> SchedulerStats:
        """The scheduler stats of the latest batch."""
        ...

    async def check_health(self) -> None:
        """Raises RuntimeError saying why when the engine cannot serve."""
        ...

    def shutdown(self) -> None: ...


def engine_facts(core: EngineCore, config: EngineConfig) -> EngineFacts:
    return EngineFacts(core.max_model_len, core.runner.vocab_size, core.runner.num_blocks, config.block_size)


class InprocEngineClient:
    """The engine core in this process. `get_outputs` runs a step on the caller's thread (so it blocks the
    event loop while it computes): for tests and the offline API, not for a server. A step that raises
    raises to the caller (the worker process instead fails the requests in flight and goes on)."""

    def __init__(self, core: EngineCore, config: EngineConfig) -> None:
        self.core = core
        self._facts = engine_facts(core, config)
        self._stats = SchedulerStats()
        self._work: asyncio.Event | None = None  # set by add_request; made by the waiting loop

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)
        if self._work is not None:
            self._work.set()

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)

    def step(self) -> EngineCoreOutputs:
        outputs = self.core.step()
        if outputs.stats is not None:
            self._stats = outputs.stats
        return outputs

    async def get_outputs(self) -> EngineCoreOutputs:
        while not self.core.has_work():
            self._work = asyncio.Event()
            await self._work.wait()
        await asyncio.sleep(0)  # let the consumers of the previous batch run first
        return self.step()

    def stats(self) -> SchedulerStats:
        return self._stats

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def run_engine_worker(config: EngineConfig, hf_dir: Path, in_addr: str, out_addr: str) -> None:
    """Entry point of the worker process. It never outlives the frontend that started it."""
    from hybridserve.engine.core import EngineCore

    child = ChildEnd(in_addr, out_addr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(EngineInput).decode
    try:
        core = EngineCore(config, hf_dir)
    except Exception as exc:
        logger.exception("engine start-up failed")
        child.failed(exc)
        return
    child.ready(engine_facts(core, config))
    while not child.orphaned():
        if not core.has_work():
            child.inbox.poll(_IDLE_POLL_MS)
        while child.inbox.poll(0):
            msg = decode(child.inbox.recv())
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
        child.outbox.send(encode(outputs))
    logger.error("engine worker: frontend process %d is gone; exiting", child.parent)


class ProcessEngineClient:
    """Starts a worker process and exchanges messages with it from an asyncio event loop."""

    def __init__(self, config: EngineConfig, hf_dir: Path) -> None:
        self._children = ChildProcesses("engine")
        # Sends are synchronous, so an abort issued while a caller is being cancelled cannot itself be
        # cancelled; receiving is asyncio.
        self._to_engine, in_addr = self._children.bind_push("in")
        self._from_engine, out_addr = self._children.bind_pull("out")
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
        self.process = self._children.spawn(run_engine_worker, (config, hf_dir, in_addr, out_addr), _WORKER_NAME)
        ready = self._children.wait_ready(self._from_engine, STARTUP_TIMEOUT_S)
        self._facts = msgspec.msgpack.decode(ready[_WORKER_NAME], type=EngineFacts)
        self._stats = SchedulerStats()

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    def add_request(self, request: EngineCoreRequest) -> None:
        self._to_engine.send(self._encode(AddRequest(request)))

    def abort(self, request_ids: list[str]) -> None:
        self._to_engine.send(self._encode(AbortRequests(request_ids)))

    async def get_outputs(self) -> EngineCoreOutputs:
        """The worker's next batch of outputs. Raises once the worker process has died, so nobody waits on
        a dead engine: the socket is polled with a timeout and the process checked in between."""
        while not await self._from_engine.poll(_LIVENESS_POLL_MS):
            await self.check_health()
        outputs = self._decode(await self._from_engine.recv())
        if outputs.stats is not None:
            self._stats = outputs.stats
        return outputs

    def stats(self) -> SchedulerStats:
        return self._stats

    async def check_health(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(f"engine worker process exited (exit code {self.process.exitcode})")

    def shutdown(self) -> None:
        self._children.shutdown(lambda _: self._to_engine.send(self._encode(Shutdown())))
