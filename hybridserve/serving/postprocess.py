"""Post-processing workers: detokenization, output parsing and event building off the HTTP event loop.

With `--num-postprocess-workers N`, a Responses request is rendered and validated on the event loop as
always, then handed to one of N worker processes as a ResponseJob. The engine's raw outputs for it
(token ids) are forwarded there; the worker detokenizes them (stop strings included), parses reasoning
and tool calls, builds the SSE frames and the terminal Response object, and sends back ready bytes plus
the token counts the frontend needs for usage and metrics. The frontend writes the bytes and, as without
workers, stores the terminal object: storing stays on.

Background responses stay on the event loop (cancel needs the output built so far, which lives there).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from hybridserve.engine.output_processor import ChoiceOutputs
from hybridserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, EngineUnavailable
from hybridserve.process import ChildEnd, ChildProcesses, freeze_startup_heap
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.errors import SERVER_ERROR, APIError
from hybridserve.serving.openai.generation import RunAccounting, engine_failure, unavailable_error, usage_body
from hybridserve.serving.openai.responses.events import ResponseFormatter
from hybridserve.serving.openai.responses.lifecycle import Ending, ResponseLifecycle
from hybridserve.serving.openai.responses.output import EventWriter
from hybridserve.serving.openai.responses.protocol import cancelled_response, failed_response, usage
from hybridserve.serving.openai.tools import ToolRequest, output_parser
from hybridserve.serving.parsers import Parsers

logger = logging.getLogger(__name__)

_POLL_MS = 1000
STARTUP_TIMEOUT_S = 120.0


class ResponseJob(msgspec.Struct, frozen=True, array_like=True, tag=True):
    request: EngineCoreRequest
    base: dict[str, Any]
    parsers: Parsers
    prompt_text: str
    tools: ToolRequest
    stream: bool


class Forward(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """One engine step's outputs for one worker's responses: one message per worker per step."""

    outputs: list[EngineCoreOutput]


class Drop(msgspec.Struct, frozen=True, array_like=True, tag=True):
    request_id: str


class Stop(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


WorkerInput = ResponseJob | Forward | Drop | Stop


class Processed(msgspec.Struct, frozen=True, array_like=True):
    """What a worker made of one engine output (or of a job's start: no tokens yet)."""

    request_id: str
    frames: bytes
    new_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None  # set once the sequence ended
    abort_engine: bool = False  # a stop string ended it: the engine request still runs
    final: dict[str, Any] | None = None  # the terminal Response object
    terminal: bytes = b""  # with `final`, when streamed: its event, held until the frontend stored it
    error: str | None = None  # an engine failure, for a non-streamed request's error response
    error_status: int = 500  # 503 when the worker serving it went down


class Results(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """What a worker made of one message: one Processed per response that has news."""

    items: list[Processed]


class _Job:
    """One Response in a worker: its sequence's text state and its formatter."""

    def __init__(self, tokenizer, job: ResponseJob) -> None:
        self.request_id = job.request.request_id
        self.prompt_tokens = len(job.request.prompt_token_ids)
        self._stopped: list[str] = []  # a stop string ended it: the frontend aborts the engine request
        self.choice = ChoiceOutputs(tokenizer, [job.request], self._stopped.extend)
        parser = output_parser(job.parsers, job.prompt_text, job.tools)
        logprobs = job.request.sampling_params.logprobs is not None
        self.formatter = ResponseFormatter(job.base, parser, job.stream, logprobs=logprobs)

    def start(self) -> Processed:
        return Processed(self.request_id, b"".join(self.formatter.start()))

    @property
    def cached_tokens(self) -> int:
        return self.choice.num_cached_tokens

    def feed(self, out: EngineCoreOutput) -> Processed | None:
        update = self.choice.feed(out)
        if update is None:
            return None
        counts = {
            "new_tokens": len(update.delta_token_ids),
            "output_tokens": update.num_output_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": update.finish_reason,
            "abort_engine": bool(self._stopped),
        }
        usage = usage_body(self.prompt_tokens, update.num_output_tokens, self.cached_tokens)
        if update.finish_reason in ("error", "abort"):
            error = engine_failure(update.finish_reason, update.error, update.unavailable)
            frames, final = self.formatter.fail(error, usage)
            return _ended(self.request_id, frames, final, error=error.message, error_status=error.status, **counts)
        frames = self.formatter.feed(update)
        if update.finish_reason is None:
            return Processed(self.request_id, b"".join(frames), **counts)
        closing, final = self.formatter.finish(update.finish_reason, usage)
        return _ended(self.request_id, frames + closing, final, **counts)


def _ended(request_id: str, frames: list[bytes], final: dict[str, Any], **fields: Any) -> Processed:
    """A response's last Processed: its frames, the terminal event (the last one, if streamed) apart."""
    terminal = frames[-1] if frames else b""
    return Processed(request_id, b"".join(frames[:-1]), final=final, terminal=terminal, **fields)


def run_postprocess_worker(hf_dir: Path, in_addr: str, out_addr: str) -> None:
    """Entry point of a post-processing worker process. It never outlives the frontend that started it."""
    from hybridserve.tokenizer import load_tokenizer

    child = ChildEnd(in_addr, out_addr)
    try:
        tokenizer = load_tokenizer(hf_dir)
    except Exception as exc:
        logger.exception("post-processing worker start-up failed")
        child.failed(exc)
        return
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(WorkerInput).decode
    freeze_startup_heap("post-processing worker")
    child.ready()
    inbox, outbox = child.inbox, child.outbox
    jobs: dict[str, _Job] = {}
    while not child.orphaned():
        if not inbox.poll(_POLL_MS):
            continue
        msg = decode(inbox.recv())
        if isinstance(msg, Stop):
            return
        if isinstance(msg, Drop):
            jobs.pop(msg.request_id, None)
            continue
        if isinstance(msg, ResponseJob):
            job = jobs[msg.request.request_id] = _Job(tokenizer, msg)
            outbox.send(encode(Results([job.start()])))
            continue
        results = []
        for output in msg.outputs:
            job = jobs.get(output.request_id)
            processed = None if job is None else _feed(job, output)
            if processed is not None:
                results.append(processed)
                if processed.finish_reason is not None:
                    del jobs[processed.request_id]
        if results:
            outbox.send(encode(Results(results)))


def _feed(job: _Job, output: EngineCoreOutput) -> Processed | None:
    try:
        return job.feed(output)
    except Exception as exc:  # a bug here must fail one response, not the worker
        logger.exception("post-processing failed for %s", job.request_id)
        error = APIError(500, f"Post-processing failed: {exc}", type=SERVER_ERROR)
        frames, final = job.formatter.fail(error, usage_body(job.prompt_tokens, 0, job.cached_tokens))
        return _ended(job.request_id, frames, final, finish_reason="error", abort_engine=True, error=str(exc))


class _Outbox:
    """The socket to one worker. Outputs forwarded during one engine step leave as one Forward message, sent
    from a callback scheduled for after the step's outputs have all been routed."""

    def __init__(self, sock: zmq.Socket, encode: Callable[[Any], bytes]) -> None:
        self.sock = sock
        self.encode = encode
        self._pending: list[tuple[_Ticket, EngineCoreOutput]] = []

    def send(self, msg: WorkerInput) -> None:
        """Never blocks: a worker that is gone (its pipe closed) fails the response instead."""
        try:
            self.sock.send(self.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise RuntimeError("the post-processing worker for this response is not running") from None

    def forward(self, ticket: _Ticket, output: EngineCoreOutput) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((ticket, output))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        try:
            self.send(Forward([output for _, output in pending]))
        except RuntimeError as exc:
            for ticket, _ in pending:
                ticket.results.put_nowait(Processed(ticket.request_id, b"", finish_reason="error", error=str(exc)))


class _Ticket:
    def __init__(self, request_id: str, worker: int, outbox: _Outbox) -> None:
        self.request_id = request_id
        self.worker = worker
        self.outbox = outbox
        self.results: asyncio.Queue[Processed] = asyncio.Queue()

    def forward(self, output: EngineCoreOutput) -> None:
        self.outbox.forward(self, output)


class PostprocessPool:
    """N worker processes; a job and its forwarded outputs go to one worker, chosen round-robin."""

    def __init__(self, hf_dir: Path, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._children = ChildProcesses("postprocess")
        self._from_workers, out_addr = self._children.bind_pull("out")
        encode = msgspec.msgpack.Encoder().encode
        self._outboxes: list[_Outbox] = []
        for k in range(num_workers):
            sock, in_addr = self._children.bind_push(f"in{k}")
            self._outboxes.append(_Outbox(sock, encode))
            self._children.spawn(run_postprocess_worker, (hf_dir, in_addr, out_addr), f"hybridserve-postprocess-{k}")
        # Every worker has loaded its tokenizer and connected before the server starts, so no send waits.
        self._children.wait_ready(self._from_workers, STARTUP_TIMEOUT_S)
        self.processes = self._children.processes
        self._decode = msgspec.msgpack.Decoder(Results).decode
        self._next = itertools.cycle(range(num_workers))
        self._tickets: dict[str, _Ticket] = {}
        self._reader: asyncio.Task[None] | None = None

    def submit(self, job: ResponseJob) -> _Ticket:
        """Sends `job` to the next worker; the ticket forwards its engine outputs and receives its results."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        worker = next(self._next)
        ticket = _Ticket(job.request.request_id, worker, self._outboxes[worker])
        self._tickets[ticket.request_id] = ticket
        ticket.outbox.send(job)
        return ticket

    def close(self, ticket: _Ticket, unfinished: bool) -> None:
        """Stops routing the ticket's results; an `unfinished` job is also dropped by its worker."""
        self._tickets.pop(ticket.request_id, None)
        if unfinished:
            with contextlib.suppress(RuntimeError):  # a worker that is gone holds nothing to drop
                ticket.outbox.send(Drop(ticket.request_id))

    async def _read(self) -> None:
        while True:
            if not await self._from_workers.poll(_POLL_MS):
                self._fail_orphans()
                continue
            msg = self._decode(await self._from_workers.recv())
            for item in msg.items:
                ticket = self._tickets.get(item.request_id)
                if ticket is not None:
                    ticket.results.put_nowait(item)

    def _fail_orphans(self) -> None:
        """Fails, once each, the responses whose worker has died; the other workers' go on."""
        for rid, ticket in list(self._tickets.items()):
            process = self.processes[ticket.worker]
            if not process.is_alive():
                del self._tickets[rid]
                error = f"post-processing worker {process.name} exited"
                ticket.results.put_nowait(Processed(rid, b"", finish_reason="error", error=error))

    def shutdown(self) -> None:
        if self._reader is not None and not self._reader.get_loop().is_closed():
            self._reader.cancel()
        self._children.shutdown(self._stop)

    def _stop(self, process: BaseProcess) -> None:
        with contextlib.suppress(RuntimeError):  # its pipe is full or gone: the join's kill ends it
            self._outboxes[self.processes.index(process)].send(Stop())


class PooledResponseRun(ResponseLifecycle):
    """A Response post-processed in a worker. If the worker itself fails, the stream still ends with error →
    failed (numbered on); a cancelled run is stored without the output so far, which only the worker had."""

    def __init__(
        self,
        engine: ServingEngine,
        pool: PostprocessPool,
        metrics: ServingMetrics,
        arrival: float,
        job: ResponseJob,
        finish: Callable[[dict[str, Any], list[bytes]], dict[str, Any]],
    ) -> None:
        super().__init__(job.base, finish)
        self.engine = engine
        self.pool = pool
        self.job = job
        self.accounting = RunAccounting(metrics, arrival, [len(job.request.prompt_token_ids)], 1)

    def usage(self) -> dict[str, Any]:
        return self.accounting.usage()

    def cancelled(self) -> dict[str, Any]:
        return cancelled_response(self.base, [], usage(self.accounting.usage()))

    async def body(self, stream: bool) -> AsyncIterator[bytes | Ending]:
        rid = self.job.request.request_id
        ticket: _Ticket | None = None
        ended = False
        sent = 0  # events sent: every frame ends with one blank line
        outcome: str | None = "abort"  # what the response counts as if we leave early
        try:
            ticket = self.pool.submit(self.job)
            await self.engine.add_requests([self.job.request], ticket.forward)
            while not ended:
                msg = await ticket.results.get()
                if msg.abort_engine:
                    self.engine.release([rid], abort=[rid])
                if msg.final is None and msg.error is not None:  # the worker itself is gone
                    raise RuntimeError(msg.error)
                reason = msg.finish_reason
                self.accounting.observe(0, 0, msg.new_tokens, msg.output_tokens, msg.cached_tokens, reason)
                if msg.final is not None:
                    ended = True
                    outcome = "error" if msg.error is not None else None
                    failure = None
                    if msg.error is not None:
                        code = "engine_unavailable" if msg.error_status == 503 else None
                        failure = APIError(msg.error_status, msg.error, type=SERVER_ERROR, code=code)
                    yield Ending(msg.final, [frames for frames in (msg.frames, msg.terminal) if frames], failure)
                elif msg.frames:
                    sent += msg.frames.count(b"\n\n")
                    yield msg.frames
        except RuntimeError as exc:
            outcome = "error"
            error = (
                unavailable_error(str(exc))
                if isinstance(exc, EngineUnavailable)
                else APIError(500, str(exc), type=SERVER_ERROR)
            )
            final = failed_response(self.base, error, self.accounting.usage())
            event = EventWriter(sent)
            frames = [event("error", code=error.code or error.type, message=error.message, param=error.param)]
            yield Ending(final, [*frames, event("response.failed", response=final)] if stream else [], error)
        finally:
            self.engine.release([rid], abort=[] if ended else [rid])
            if ticket is not None:
                self.pool.close(ticket, unfinished=not ended)
            self.accounting.close(outcome)
