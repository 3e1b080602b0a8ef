"""The scheduler half of a KV connector: which requests a worker holds for their readers and which it reads, kept
beside the scheduler's books and decided there; the worker half (connector_worker.py) moves the bytes.

A prefill worker HOLDS a request it prefilled for a decode worker under a lease: until the reader says it is done
or gave up (`done` / `drop`, heard by the worker half), or the lease runs out (pushed back by `keep` from a reader
still queued for room). A decode worker admits a request into PULLING once the bytes in flight leave room for its
read (`kv_transfer_max_bytes`, always room for one), and orders the read; the worker half reports it landed,
failed (its blocks free again: the request fails or is prefilled here, `kv_transfer_failure`), or stuck (over,
but NIXL still holds it: the request ends for its client now and keeps its blocks until the read is freed).

Nothing here touches a tensor or NIXL: the decisions since the last step are collected into `TransferOrders`,
which travel in the step's plan, and the worker half answers with `TransferEvents`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from hybridserve.config import TransferConfig
from hybridserve.engine.kv_transfer.leases import Leases
from hybridserve.engine.kv_transfer.messages import PullOrder, TransferOrders, TransferSource
from hybridserve.engine.protocol import EngineCoreOutput, FinishReason
from hybridserve.engine.request import Request

logger = logging.getLogger("hybridserve.kv_transfer")


class ConnectorScheduler:
    def __init__(
        self,
        settings: TransferConfig,
        agent: str,
        bytes_per_block: int,
        bytes_per_state_slot: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`agent`: this worker's NIXL agent, named in what it holds for decode workers; the byte counts are of a
        KV block and a state slot here, for the bound on reads in flight."""
        self.settings = settings
        self.agent = agent
        self.clock = clock
        self._block_bytes = bytes_per_block
        self._state_bytes = bytes_per_state_slot
        self.held: dict[str, Request] = {}  # prefilled for a decode worker, blocks kept until released
        self.pulling: dict[str, Request] = {}  # blocks being filled by a read from a prefill worker
        self.leases = Leases(settings.kv_lease)
        self.leases_expired = 0
        self._reading: dict[str, int] = {}  # pulling requests whose read is ordered and not over: its bytes
        self._ended: set[str] = set()  # pulling requests over for their clients, blocks waiting for NIXL
        self._peer_leases: dict[str, float] = {}  # prefill workers met: how long they hold a request for us
        self._kept: dict[str, float] = {}  # readers queued for room: when their prefill worker last heard `keep`
        self._orders = TransferOrders()

    def meet(self, agent: str, lease_s: float) -> None:
        """A prefill worker the worker half accepted: its readers queued here keep its lease alive."""
        self._peer_leases[agent] = lease_s

    # ---- the decode side

    def _bytes(self, source: TransferSource) -> int:
        return len(source.block_ids) * self._block_bytes + (self._state_bytes if source.state_slot >= 0 else 0)

    def has_room(self, req: Request) -> bool:
        """Whether `req`'s read fits beside those in flight (a first read always does)."""
        assert req.pull_from is not None
        inflight = sum(self._reading.values())
        return not self._reading or inflight + self._bytes(req.pull_from) <= self.settings.kv_transfer_max_bytes

    def pull(self, req: Request, block_ids: list[int], state_slot: int) -> None:
        """`req` was admitted into these blocks (and state slot): order its read."""
        source = req.pull_from
        assert source is not None
        rid = req.request_id
        self.pulling[rid] = req
        self._reading[rid] = self._bytes(source)
        self._kept.pop(rid, None)
        self._orders.pulls.append(PullOrder(rid, source, block_ids, state_slot))

    def landed(self, request_id: str) -> Request:
        del self._reading[request_id]
        return self.pulling.pop(request_id)

    def failed(self, request_id: str, why: str) -> tuple[Request, str | None]:
        """A read over without landing, its blocks free again: the request, and the error it ends with (None: it
        is to be prefilled here instead)."""
        del self._reading[request_id]
        req = self.pulling[request_id]
        if self.settings.kv_transfer_failure == "recompute":
            logger.warning("request %s: KV transfer failed (%s); prefilling it here instead", request_id, why)
            return req, None
        logger.warning("request %s: KV transfer failed: %s", request_id, why)
        return req, self._error(req, why)

    def stuck(self, request_id: str, why: str) -> EngineCoreOutput:
        """A read over without landing that NIXL still holds: the request ends for its client now, and keeps its
        blocks (it stays pulling) until the read is freed."""
        del self._reading[request_id]
        self._ended.add(request_id)
        logger.warning("request %s: KV transfer failed: %s", request_id, why)
        error = self._error(self.pulling[request_id], why)
        return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=error)

    def _error(self, req: Request, why: str) -> str:
        assert req.pull_from is not None
        return f"KV transfer from prefill worker {req.pull_from.agent} failed: {why}"

    def drop(self, req: Request) -> bool:
        """`req`, which was to read from a prefill worker, ends (its client left): the prefill worker is told and
        a read in flight cancelled. False if it had ended for its client already."""
        assert req.pull_from is not None
        rid = req.request_id
        if rid in self._ended:
            return False
        self._kept.pop(rid, None)
        self._reading.pop(rid, None)
        if rid in self.pulling:
            self._ended.add(rid)
        self._orders.drops.append((rid, req.pull_from))
        return True

    def forget(self, request_id: str) -> None:
        """A pulling request ends (failed, freed, aborted): nothing of it is kept here."""
        self.pulling.pop(request_id, None)
        self._reading.pop(request_id, None)
        self._ended.discard(request_id)

    def keep_waiting(self, waiting: Iterable[Request]) -> None:
        """Readers still queued for room ask their prefill workers to hold on (every third of the lease)."""
        now = self.clock()
        for req in waiting:
            source = req.pull_from
            if source is None:
                continue
            lease = self._peer_leases.get(source.agent)
            last = self._kept.setdefault(req.request_id, now)
            if lease is not None and now - last >= lease / 3:
                self._orders.keeps.append(source)
                self._kept[req.request_id] = now

    # ---- the prefill side

    def hold(self, req: Request, block_ids: list[int], state_slot: int) -> TransferSource:
        """After its first token `req` waits, with these blocks and state slot, for a decode worker to read it."""
        self.held[req.request_id] = req
        self.leases.hold(req.request_id, self.clock())
        return TransferSource(
            self.agent, req.request_id, block_ids, state_slot, len(req.prompt_token_ids), req.num_cached_tokens
        )

    def release(self, request_id: str) -> Request | None:
        """A held request's reader is done or gave up, its lease ran out, or its frontend dropped it."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.leases.release(request_id)
            self._orders.releases.append(request_id)
        return req

    def to_release(self, heard: Iterable[tuple[str, str]]) -> list[str]:
        """The held requests to let go after what readers said (`done`, `drop`; `keep` pushes a lease back) and
        the leases that ran out."""
        now = self.clock()
        gone: list[str] = []
        for kind, rid in heard:
            if kind == "keep":
                self.leases.extend(rid, now)
            elif rid in self.held:
                gone.append(rid)
        for rid in self.leases.expired(now):
            self.leases_expired += 1
            logger.warning(
                "request %s: no decode worker read it within %gs; its blocks go back", rid, self.leases.lease_s
            )
            gone.append(rid)
        return gone

    # ---- both

    def take_orders(self) -> TransferOrders:
        """The decisions since the last call, for the worker half."""
        orders, self._orders = self._orders, TransferOrders()
        return orders

    @property
    def busy(self) -> bool:
        """Held or pulling requests, or orders not yet taken: the worker half needs polling soon."""
        return bool(self.held or self.pulling or self._orders)

    def check_integrity(self) -> None:
        held = set(self.held)
        if held != {rid for rid in held if rid in self.leases} or len(self.leases) != len(held):
            raise AssertionError(f"held requests {sorted(held)} != leased {len(self.leases)}")
        if set(self._reading) | self._ended != set(self.pulling) or set(self._reading) & self._ended:
            raise AssertionError(
                f"pulling {sorted(self.pulling)} != reading {sorted(self._reading)} + ended {sorted(self._ended)}"
            )
