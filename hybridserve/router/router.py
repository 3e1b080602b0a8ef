"""The router: an EngineClient over one or more engine workers, local (spawned here) or remote.

It picks a worker for each new request (every choice of an n > 1 request goes to the same one), sends aborts
to the worker that holds the request, merges the workers' outputs into one stream, and keeps each worker's
state: a heartbeat deadline (a worker that stops answering, killed or stopped, is marked down), the requests
it holds (failed with a clear, retryable error when it goes down, while every other request runs on), and
its part of the KV index. Down and refused workers are retried with backoff, checked again, and rejoin; a
local worker whose process died is started again first.

Start-up is synchronous (before any event loop runs): every local worker must come up, and at least one
worker in all, each checked against the model this frontend serves (`WorkerIdentity`). The first accepted
worker fixes what the others must match (dtype, block size, context length), and a worker that differs is
refused with both values named, then retried later, never used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from hybridserve.engine.cache.events import CachedSet
from hybridserve.engine.cache.prefix_hash import hash_blocks
from hybridserve.engine.protocol import (
    AbortRequests,
    AddRequest,
    CheckIntegrity,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    EngineUnavailable,
    FinishReason,
    GetCachedSet,
    Hello,
    IntegrityReport,
    Ping,
    Pong,
    Refused,
    SchedulerStats,
    Welcome,
    WorkerIdentity,
    WorkerStatus,
    protocol_fingerprint,
)
from hybridserve.router.disagg import Disaggregation
from hybridserve.router.index import KVIndex
from hybridserve.router.link import HandshakeRefused, WorkerExited, WorkerLink, WorkerState
from hybridserve.router.policy import Candidate, Policy, Routing

logger = logging.getLogger("hybridserve.router")

HEARTBEAT_S = 1.0
MAX_BACKOFF_S = 30.0
STARTUP_TIMEOUT_S = 600.0  # a local worker loading its model
MAX_START_FAILURES = 3  # a local worker that fails to start this often in a row, with no worker up, is fatal
_POLL_MS = 200
_SETTLE_S = 2.0  # at start-up, how long the other remote workers may take to answer after the first
_EXIT_POLLS = 10


@dataclass(frozen=True)
class RouterSettings:
    routing: Routing = Routing.KV_AWARE
    temperature: float = 0.0
    worker_timeout_s: float = 10.0  # transport heartbeats missed this long: the worker counts as down
    worker_step_timeout_s: float = 300.0  # its connection alive but its engine loop silent this long: hung
    secret: str = ""  # the workers' shared secret
    seed: int = 0
    prefix_weight: float = 4.0  # kv_aware: a cached block against a block of load
    max_local_prefill_tokens: int = 256  # disaggregated: a decode worker prefills an uncached part this short


@dataclass(frozen=True)
class ExpectedModel:
    """What every worker must have loaded: this frontend's own checkpoint."""

    model: str
    weights: str
    tokenizer: str


class Router:
    def __init__(
        self,
        links: list[WorkerLink],
        expected: ExpectedModel,
        settings: RouterSettings,
        respawn: Callable[[WorkerLink], None] | None = None,
        on_shutdown: Callable[[], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        if not links:
            raise ValueError("a router needs at least one worker")
        self.links = links
        self.expected = expected
        self.settings = settings
        self.respawn = respawn  # starts a local worker's process again
        self.on_shutdown = on_shutdown  # stops the local workers' processes
        self.on_fatal = on_fatal  # the deployment cannot serve again: the server should exit non-zero
        self.frontend = uuid.uuid4().hex
        self.identity: WorkerIdentity | None = None  # of the first accepted worker: the deployment's
        self.index = KVIndex()
        self.policy: Policy | None = None
        self.disagg: Disaggregation | None = None  # with prefill and decode pools
        self._owner: dict[str, WorkerLink] = {}  # request id → the worker running it
        # Handed to a decode worker, not yet heard of there: the prefill worker holding its KV, told to let go
        # if the decode worker refuses it or goes down first (rather than after the lease).
        self._held_on: dict[str, WorkerLink] = {}
        self._ctx = zmq.asyncio.Context()
        self._queue: asyncio.Queue[EngineCoreOutputs] | None = None
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}  # per worker: its readers
        self._maintenance: asyncio.Task[None] | None = None
        self._settled = asyncio.Event()  # no worker is still opening its first session
        self._integrity: dict[str, asyncio.Future[IntegrityReport]] = {}  # asked, per worker

    # ---- start-up (before the event loop)

    def wait_for_workers(self, timeout_s: float, require_all: bool) -> None:
        """Blocks until every worker (`require_all`, local ones) or at least one answered and was accepted.
        Raises EngineUnavailable naming each worker's problem when time runs out or a local one exits."""
        ctx = zmq.Context()
        try:
            self._wait(ctx, timeout_s, require_all)
        finally:
            ctx.destroy(linger=0)

    def _wait(self, ctx: zmq.Context, timeout_s: float, require_all: bool) -> None:
        replies, silent = self._gather_replies(ctx, timeout_s, require_all)
        accepted = 0
        for link in self.links:  # in the order given: the first accepted fixes the deployment's geometry
            if (reply := replies.get(link.name)) is None:
                continue
            problem = self._check(link, reply) if isinstance(reply, Welcome) else reply.error
            if problem is None:
                accepted += 1
            else:
                self._set_state(link, WorkerState.REFUSED, problem)
        if require_all and any(link.state is WorkerState.REFUSED for link in self.links):
            raise EngineUnavailable("; ".join(f"worker {w.name}: {w.error}" for w in self.links if w.error))
        if not accepted:
            waiting = [f"worker {name}: no answer within {timeout_s:g}s" for name in silent]
            problems = [f"worker {w.name}: {w.error}" for w in self.links if w.error]
            raise EngineUnavailable("no engine worker is available: " + "; ".join(problems + waiting))
        for link in self.links:
            if link.name in silent:  # the others are up: it is retried in the background
                self._set_state(link, WorkerState.DOWN, "no answer at start-up")
        assert self.identity is not None
        block_size = self.identity.facts.block_size
        self.policy = Policy(
            self.settings.routing,
            block_size,
            self.settings.temperature,
            self.settings.seed,
            self.settings.prefix_weight,
        )
        if any(link.role != "both" for link in self.links):
            self.disagg = Disaggregation(self.links, block_size, self.settings.max_local_prefill_tokens)

    def _gather_replies(
        self, ctx: zmq.Context, timeout_s: float, require_all: bool
    ) -> tuple[dict[str, Welcome | Refused], set[str]]:
        """Greets every worker and collects their answers, by worker name, until all answered, time ran out, or
        (not `require_all`) the others had _SETTLE_S after the first Welcome; also the names that never answered.
        Raises EngineUnavailable when a local worker exits meanwhile."""
        pending: dict[str, zmq.Socket] = {}
        for link in self.links:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(link.address)
            sock.send(_encode(Hello(self.frontend, uuid.uuid4().hex, self.settings.secret, protocol_fingerprint())))
            pending[link.name] = sock
        deadline = time.monotonic() + timeout_s
        replies: dict[str, Welcome | Refused] = {}
        welcomed: float | None = None  # when the first Welcome came
        while pending:
            for link in self.links:
                if (sock := pending.get(link.name)) is None:
                    continue
                if link.process is not None and not link.process.is_alive():
                    raise EngineUnavailable(
                        f"worker {link.name} exited during start-up (exit code "
                        f"{link.process.exitcode}); its log above says why"
                    )
                if sock.poll(0):
                    del pending[link.name]
                    replies[link.name] = reply = _decode(sock.recv())
                    if welcomed is None and isinstance(reply, Welcome):
                        welcomed = time.monotonic()
            # Remote workers: up to _SETTLE_S more for the others once one answered, so that the deployment is
            # fixed by the order of --worker, not by which worker answered first.
            settled = not require_all and welcomed is not None and time.monotonic() - welcomed >= _SETTLE_S
            if settled or time.monotonic() > deadline:
                break
            time.sleep(_POLL_MS / 1000)
        return replies, set(pending)

    def _check(self, link: WorkerLink, welcome: Welcome) -> str | None:
        """Why this worker cannot serve this deployment (None: it can); the first one fixes the geometry."""
        if welcome.role != link.role:
            return f"it runs with --role {welcome.role}, but this deployment uses it as a {link.role} worker"
        if link.role != "both" and welcome.transfer is None:
            return f"it is a {link.role} worker without a KV-transfer endpoint"
        link.transfer = welcome.transfer
        identity = welcome.identity
        ours = self.expected
        for name, theirs, mine in (
            ("model", identity.model, ours.model),
            ("weights fingerprint", identity.weights, ours.weights),
            ("tokenizer fingerprint", identity.tokenizer, ours.tokenizer),
        ):
            if theirs != mine:
                return f"it serves {name} {theirs!r}, but this frontend serves {mine!r}"
        if self.identity is None:
            self.identity = identity
        elif (mismatch := self.identity.mismatch(identity)) is not None:
            first = next(w.name for w in self.links if w.identity == self.identity)
            return f"{mismatch} (the deployment's, set by worker {first})"
        link.identity = identity
        return None

    @property
    def facts(self) -> EngineFacts:
        assert self.identity is not None, "wait_for_workers first"
        return self.identity.facts

    # ---- the event loop's side

    def _ensure_started(self) -> None:
        if self._queue is not None:
            return
        self._queue = asyncio.Queue()
        for link in self.links:  # the workers accepted at start-up are still CONNECTING: their sessions open now
            if link.state is not WorkerState.CONNECTING:
                link.retry_at = time.monotonic() + HEARTBEAT_S
        self._maintenance = asyncio.get_running_loop().create_task(self._maintain())

    async def _maintain(self) -> None:
        """Every heartbeat: ping who is up, mark down who missed the deadline, (re)connect who is due."""
        while True:
            now = time.monotonic()
            for link in self.links:
                if link.state is WorkerState.UP:
                    self._watch(link, now)
                elif (link.state is WorkerState.CONNECTING or now >= link.retry_at) and link.name not in self._tasks:
                    self._tasks[link.name] = [asyncio.create_task(self._connect(link))]
            await asyncio.sleep(HEARTBEAT_S)

    def _watch(self, link: WorkerLink, now: float) -> None:
        """A worker whose connection is alive may be inside a long step (its loop answers pings between steps):
        only a silence past the step timeout counts as a hung engine."""
        deadline = self.settings.worker_step_timeout_s
        if link.process is not None and not link.process.is_alive():
            self._mark_down(link, f"its process exited (exit code {link.process.exitcode})")
        elif now - link.last_heard > deadline:
            silence = now - link.last_heard
            self._mark_down(link, f"its engine loop answered nothing for {silence:.1f}s (step timeout {deadline:g}s)")
        else:
            link.send(Ping())

    async def _connect(self, link: WorkerLink) -> None:
        try:
            if link.process is not None and not link.process.is_alive() and self.respawn is not None:
                link.restarts += 1
                logger.warning("worker %s: starting its process again (restart %d)", link.name, link.restarts)
                self.respawn(link)
            try:
                welcome = await link.connect(
                    self._ctx,
                    self.frontend,
                    self.settings.secret,
                    self._connect_timeout(link),
                    self.settings.worker_timeout_s,
                )
            except (TimeoutError, HandshakeRefused, WorkerExited) as exc:
                refused = isinstance(exc, HandshakeRefused)
                self._retry_later(link, WorkerState.REFUSED if refused else WorkerState.DOWN, str(exc))
                if isinstance(exc, WorkerExited):
                    link.start_failures += 1
                    self._give_up_if_hopeless(link)
                return
            if (problem := self._check(link, welcome)) is not None:
                link.close()
                self._retry_later(link, WorkerState.REFUSED, problem)
                return
            self.index.add_worker(link.name, welcome.identity.recurrent_state)
            link.subscribe(self._ctx, welcome.events_address)
            link.failures = link.start_failures = 0
            self._set_state(link, WorkerState.UP, None)
            self._tasks[link.name] = [
                asyncio.create_task(self._read(link)),
                asyncio.create_task(self._read_events(link)),
                asyncio.create_task(self._watch_connection(link)),
            ]
            link.send(GetCachedSet())
        finally:
            tasks = self._tasks.get(link.name)
            if tasks and tasks[0] is asyncio.current_task():
                del self._tasks[link.name]

    def _connect_timeout(self, link: WorkerLink) -> float:
        """A starting local process loads its model first; a remote worker answers at once or is down."""
        return STARTUP_TIMEOUT_S if link.process is not None else self.settings.worker_timeout_s

    def _give_up_if_hopeless(self, link: WorkerLink) -> None:
        """A local worker that keeps failing to start while no worker serves: nothing here will recover, so a
        supervisor should see the server exit."""
        serving = any(w.state in (WorkerState.UP, WorkerState.CONNECTING) for w in self.links)
        if link.start_failures >= MAX_START_FAILURES and not serving and self.on_fatal is not None:
            self.on_fatal(f"worker {link.name} failed to start {link.start_failures} times in a row ({link.error})")

    def _retry_later(self, link: WorkerLink, state: WorkerState, why: str) -> None:
        link.failures += 1
        link.retry_at = time.monotonic() + min(MAX_BACKOFF_S, HEARTBEAT_S * 2 ** (link.failures - 1))
        self._set_state(link, state, why)

    def _set_state(self, link: WorkerLink, state: WorkerState, why: str | None) -> None:
        if state is not link.state or why != link.error:
            log = logger.info if state in (WorkerState.UP, WorkerState.CONNECTING) else logger.warning
            log("worker %s: %s%s", link.name, state, f" ({why})" if why else "")
        link.state, link.error = state, why
        if any(w.state is WorkerState.CONNECTING for w in self.links):
            self._settled.clear()
        else:
            self._settled.set()

    async def _read(self, link: WorkerLink) -> None:
        assert self._queue is not None
        while True:
            msg = await link.recv()
            link.last_heard = time.monotonic()
            if isinstance(msg, EngineCoreOutputs):
                self._account(link, msg)
                self._queue.put_nowait(msg)
            elif isinstance(msg, Pong):
                link.stats = msg.stats
            elif isinstance(msg, CachedSet):
                if not self.index.load(link.name, msg):
                    link.send(GetCachedSet())
            elif isinstance(msg, IntegrityReport):
                future = self._integrity.pop(link.name, None)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, Refused):  # it dropped our session (it restarted, or found us silent)
                self._mark_down(link, f"it ended the session: {msg.error}")
                return

    async def _watch_connection(self, link: WorkerLink) -> None:
        await link.disconnected()
        process = link.process
        for _ in range(_EXIT_POLLS):  # a dying local worker closes its socket on the way out: say how it ended
            if process is None or not process.is_alive():
                break
            await asyncio.sleep(_POLL_MS / 1000 / _EXIT_POLLS)
        if process is not None and not process.is_alive():
            self._mark_down(link, f"its process exited (exit code {process.exitcode})")
            return
        timeout = self.settings.worker_timeout_s
        self._mark_down(link, f"its connection dropped (closed, or no transport heartbeat answered in {timeout:g}s)")

    async def _read_events(self, link: WorkerLink) -> None:
        while True:
            batch = await link.recv_events()
            if not self.index.apply(link.name, batch):
                link.send(GetCachedSet())

    def _account(self, link: WorkerLink, batch: EngineCoreOutputs) -> None:
        if batch.stats is not None:
            link.stats = batch.stats
        for out in batch.outputs:
            if out.request_id not in link.requests:
                continue
            held_on = self._held_on.pop(out.request_id, None)
            if held_on is not None and out.finish_reason is not None and not out.new_token_ids:
                held_on.send(AbortRequests([out.request_id]))  # refused before it read anything
            if out.finish_reason is not None:
                link.release(out.request_id)
                self._owner.pop(out.request_id, None)
                if self.disagg is not None:
                    self.disagg.pending.pop(out.request_id, None)
            elif out.kv_transfer is not None:
                link.release(out.request_id)
                if self.disagg is not None and out.request_id in self.disagg.pending:
                    self._hand_off(link, out)
                else:  # aborted while its prefill finished: the prefill worker lets go of its copy now
                    link.send(AbortRequests([out.request_id]))
            else:
                link.grow(out.request_id, len(out.new_token_ids))

    def _hand_off(self, prefill: WorkerLink, out: EngineCoreOutput) -> None:
        """A prefill worker is done with a request: it goes on at its decode worker (which reads the KV)."""
        assert self.disagg is not None and self._queue is not None
        rid = out.request_id
        try:
            target, messages = self.disagg.hand_off(prefill, out, self._pick)
        except LookupError as exc:
            self._owner.pop(rid, None)
            prefill.send(AbortRequests([rid]))  # nobody will read what it holds
            error = EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=str(exc), unavailable=True)
            self._queue.put_nowait(EngineCoreOutputs([error]))
            return
        target.hold(rid, out.num_prompt_tokens + 1)
        self._owner[rid] = target
        self._held_on[rid] = prefill
        for message in messages:
            target.send(message)

    def _mark_down(self, link: WorkerLink, why: str) -> None:
        """Fails exactly the requests this worker held; the others go on. It is retried with backoff."""
        for task in self._tasks.pop(link.name, []):
            if task is not asyncio.current_task():
                task.cancel()
        link.close()
        self.index.drop_worker(link.name)
        error = f"engine worker {link.name} went down: {why}"
        failed = [
            EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=error, unavailable=True)
            for rid in link.requests
        ]
        for rid in link.requests:
            self._owner.pop(rid, None)
            if self.disagg is not None:
                self.disagg.pending.pop(rid, None)
            if (held_on := self._held_on.pop(rid, None)) is not None:
                held_on.send(AbortRequests([rid]))  # no reader is coming: the prefill worker lets go now
        link.release_all()
        link.stats = SchedulerStats()
        self._retry_later(link, WorkerState.DOWN, why)
        if failed:
            logger.warning("worker %s: failing its %d requests", link.name, len(failed))
            assert self._queue is not None
            self._queue.put_nowait(EngineCoreOutputs(failed))

    # ---- EngineClient

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Routes requests that belong together (the choices of one request) to one worker."""
        self._ensure_started()
        if not self._settled.is_set():  # right after start-up: routing waits until every session is open
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), self.settings.worker_timeout_s)
        if not any(w.state is WorkerState.UP for w in self.links):
            raise EngineUnavailable(
                "no engine worker is available: "
                + "; ".join(f"worker {w.name} is {w.state}" + (f" ({w.error})" if w.error else "") for w in self.links)
            )
        if self.disagg is not None:
            link, requests = self.disagg.route(requests, self._pick)
        else:
            link = self._pick([w for w in self.links if w.state is WorkerState.UP], requests[0].prompt_token_ids)[0]
        for request in requests:  # its load: the tokens it holds in the worker's KV cache, prompt and output
            link.hold(request.request_id, len(request.prompt_token_ids))
            self._owner[request.request_id] = link
            link.send(AddRequest(request))

    def _pick(self, up: list[WorkerLink], prompt: list[int]) -> tuple[WorkerLink, int]:
        """The policy's choice among `up` for this prompt, and the prompt blocks it holds."""
        assert self.policy is not None and self.identity is not None
        bs = self.identity.facts.block_size
        usable = (len(prompt) - 1) // bs * bs  # the last prompt token is always computed
        hashes = hash_blocks(prompt[:usable], bs) if self.policy.routing is Routing.KV_AWARE else []
        matched = self.index.match(hashes) if hashes else {}
        candidates = [Candidate(w.name, w.load_tokens, matched.get(w.name, 0)) for w in up]
        chosen = self.policy.pick(candidates, len(hashes))
        link = next(w for w in up if w.name == chosen.worker)
        if chosen.matched_blocks:
            link.routed_hits += 1
            link.matched_blocks += chosen.matched_blocks
        else:
            link.routed_misses += 1
        return link, chosen.matched_blocks

    def abort(self, request_ids: list[str]) -> None:
        by_link: dict[str, list[str]] = {}
        for rid in request_ids:
            if self.disagg is not None:
                self.disagg.pending.pop(rid, None)
            link = self._owner.get(rid)
            if link is not None:
                by_link.setdefault(link.name, []).append(rid)
            if (held_on := self._held_on.pop(rid, None)) is not None:
                by_link.setdefault(held_on.name, []).append(rid)
        for link in self.links:
            if link.name in by_link:
                link.send(AbortRequests(by_link[link.name]))

    async def get_outputs(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self._queue is not None
        return await self._queue.get()

    def stats(self) -> SchedulerStats:
        """The workers' stats summed (fractions averaged over the workers that are up)."""
        up = [w.stats for w in self.links if w.state is WorkerState.UP] or [SchedulerStats()]
        total = {f: sum(getattr(s, f) for s in up) for f in SchedulerStats.__struct_fields__}
        for fraction in ("kv_cache_usage", "state_snapshot_usage"):
            total[fraction] /= len(up)
        return SchedulerStats(**total)

    def workers(self) -> list[WorkerStatus]:
        return [
            WorkerStatus(
                w.name,
                str(w.state),
                w.error,
                w.stats,
                str(self.settings.routing),
                w.load_tokens,
                w.routed_hits,
                w.routed_misses,
                w.matched_blocks,
                w.restarts,
                w.role,
            )
            for w in self.links
        ]

    async def check_integrity(self, timeout_s: float = 10.0) -> dict[str, IntegrityReport]:
        """Every up worker's cache integrity check, run now, by worker name (tests and operators)."""
        self._ensure_started()
        loop = asyncio.get_running_loop()
        asked = {}
        for link in self.links:
            if link.state is WorkerState.UP:
                asked[link.name] = self._integrity.setdefault(link.name, loop.create_future())
                link.send(CheckIntegrity())
        return {name: await asyncio.wait_for(future, timeout_s) for name, future in asked.items()}

    async def check_health(self) -> None:
        self._ensure_started()
        if not any(w.state in (WorkerState.UP, WorkerState.CONNECTING) for w in self.links):
            raise EngineUnavailable(
                "no engine worker is up: " + "; ".join(f"{w.name} {w.state} ({w.error})" for w in self.links)
            )

    def shutdown(self) -> None:
        """Closes every session (a worker aborts what this frontend still had running there) and stops the
        local workers. Safe after the event loop has closed."""
        tasks = [self._maintenance, *(t for ts in self._tasks.values() for t in ts)]
        for task in tasks:
            if task is not None and not task.get_loop().is_closed():
                task.cancel()
        for link in self.links:
            link.close()
        self._ctx.destroy(linger=0)
        if self.on_shutdown is not None:
            self.on_shutdown()


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Welcome | Refused).decode
