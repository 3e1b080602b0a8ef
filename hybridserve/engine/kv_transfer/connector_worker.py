"""The worker half of a KV connector: the NIXL agent over this worker's cache tensors, moving the bytes the
scheduler half (connector_scheduler.py) decided on. A decode worker starts the reads it is ordered to, each
bounded by a deadline, and reports them landed, failed or stuck; a prefill worker packs what it holds for readers
into its staging arena and reports what the readers tell it. Nothing here decides what a request becomes.

Notifications between the two workers ride NIXL itself: `done:<id>` (read landed), `drop:<id>` (the reader gave
up or its client left) and `keep:<id>` (still waiting for room: push the lease back).

Staging (arena.py): a side whose blocks for a request lie in runs shorter than `staging_min_run` on average packs
them into a span of its staging arena (the prefill side at hold, the decode side reads into one and scatters it
when the read lands), so the read is one descriptor instead of one per block and plane. No room: straight reads.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import torch

from hybridserve.config import TransferConfig
from hybridserve.engine.cache.allocation import zeroed
from hybridserve.engine.kv_transfer.agent import Read, TransferAgent, TransferError
from hybridserve.engine.kv_transfer.arena import StagingArena
from hybridserve.engine.kv_transfer.layout import (
    kv_bytes_per_block,
    mean_run,
    mismatch,
    pack,
    read_descriptors,
    tensor_layouts,
    unpack,
)
from hybridserve.engine.kv_transfer.messages import (
    PullOrder,
    TransferEndpoint,
    TransferEvents,
    TransferOrders,
    TransferSource,
)
from hybridserve.engine.protocol import EngineCoreOutput
from hybridserve.models.cache_specs import CacheLayout

logger = logging.getLogger("hybridserve.kv_transfer")


@dataclass
class _Pull:
    """A request's read: its KV part and (hybrid models) its state part, each one NIXL read, timed apart."""

    order: PullOrder
    started: float
    deadline: float
    reads: dict[str, Read]  # by part, while in flight
    nbytes: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)  # by part, once done
    staged: bool = False  # the KV part lands in the request's staging span, to be scattered into its blocks


@dataclass
class TransferCounters:
    pulls_done: int = 0
    pulls_failed: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0
    kv_seconds: float = 0.0  # summed over reads, from start to seen done
    state_seconds: float = 0.0
    staged: int = 0  # requests whose KV this side packed into (or scattered from) its staging arena
    refused_peers: dict[str, str] = field(default_factory=dict)  # agent → why it cannot be read from


class ConnectorWorker:
    def __init__(
        self, settings: TransferConfig, layout: CacheLayout, caches: list[object], device: torch.device, weights: str
    ) -> None:
        self.settings = settings
        tensors = [t for c in caches for t in (c if isinstance(c, tuple) else (c,))]
        layouts = tensor_layouts(layout.layer_specs, caches)
        self._kv = [(c, t.dim) for c, t in zip(tensors, layouts, strict=True) if t.kind == "kv"]  # for packing
        memory = "VRAM" if device.type == "cuda" else "DRAM"
        name = f"hybridserve-{settings.role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.arena: StagingArena | None = None
        if settings.kv_staging_bytes:
            self.arena = StagingArena(zeroed((settings.kv_staging_bytes,), torch.uint8, device))
            tensors.append(self.arena.tensor)
        self.agent = TransferAgent(name, tensors, memory)
        self.endpoint = TransferEndpoint(
            name,
            self.agent.metadata,
            weights,
            layout.block_size,
            memory,
            layouts,
            settings.kv_lease,
            arena=self.arena.address if self.arena is not None else 0,
        )
        self._kv_block_bytes = kv_bytes_per_block(layouts)
        self.peers: dict[str, TransferEndpoint] = {}
        self.counters = TransferCounters()
        self._pulls: dict[str, _Pull] = {}  # reads in flight, by request id
        self._zombies: dict[str, _Pull] = {}  # ended reads NIXL would not release yet: their blocks wait

    # ---- first contact

    def add_peer(self, endpoint: TransferEndpoint) -> bool:
        """A prefill worker this one may read from: checked against our layout once, the answer remembered.
        Returns whether it can be read from."""
        if endpoint.agent in self.peers or endpoint.agent in self.counters.refused_peers:
            return endpoint.agent in self.peers
        problem = mismatch(self.endpoint, endpoint)
        if problem is None:
            try:
                self.agent.add_peer(endpoint.metadata)
            except Exception as exc:  # metadata NIXL cannot use: as incompatible as a wrong layout
                problem = f"NIXL refused its metadata: {type(exc).__name__}: {exc}"
        if problem is not None:
            logger.warning("prefill worker %s cannot be read from: %s", endpoint.agent, problem)
            self.counters.refused_peers[endpoint.agent] = problem
            return False
        self.peers[endpoint.agent] = endpoint
        return True

    def check(self, source: TransferSource) -> str | None:
        """Why a read from `source` cannot be made here (None: it can)."""
        if (problem := self.counters.refused_peers.get(source.agent)) is not None:
            return f"prefill worker {source.agent} is incompatible with this decode worker: {problem}"
        if source.agent not in self.peers:
            return f"prefill worker {source.agent} is unknown here (the frontend did not introduce it)"
        return None

    # ---- orders

    def execute(self, orders: TransferOrders) -> TransferEvents:
        """Carries out the scheduler half's orders: spans of released requests go back, readers still queued
        keep their leases, dropped reads are cancelled (their prefill workers told), and admitted reads start."""
        events = TransferEvents()
        for rid in orders.releases:
            self._unstage(rid)
        for source in orders.keeps:
            self.agent.notify(source.agent, b"keep:" + source.handle.encode())
        for rid, source in orders.drops:
            self.agent.notify(source.agent, b"drop:" + source.handle.encode())
            pull = self._pulls.pop(rid, None)
            if pull is None:
                continue
            if self._cancel_all(pull):
                self._unstage(rid)
                events.freed.append(rid)
            else:
                self._zombies[rid] = pull
        now = time.monotonic()
        for order in orders.pulls:
            self._start(order, now, events)
        return events

    def _start(self, order: PullOrder, now: float, events: TransferEvents) -> None:
        source, rid = order.source, order.request_id
        peer = self.peers[source.agent]
        blocks = (source.block_ids, order.block_ids)
        slots = (source.state_slot, order.state_slot) if source.state_slot >= 0 else None
        theirs = peer.arena + source.staged if source.staged >= 0 else None
        ours = self._stage(rid, order.block_ids)
        staged = (theirs, ours.data_ptr() if ours is not None else None)
        parts = read_descriptors(self.endpoint.tensors, peer.tensors, blocks, slots, staged)
        pull = _Pull(order, now, now + self.settings.kv_transfer_timeout, {}, {p: d.nbytes for p, d in parts.items()})
        pull.staged = ours is not None
        try:
            for part, d in parts.items():
                pull.reads[part] = self.agent.read(source.agent, d.local, d.remote)
        except TransferError as exc:
            self._failed(pull, str(exc), events)
            return
        self._pulls[rid] = pull

    def _stage(self, rid: str, blocks: list[int]) -> torch.Tensor | None:
        """A staging span for the request's KV when its blocks here are fragmented and the arena has room."""
        arena = self.arena
        if arena is None or not blocks or mean_run(blocks) >= self.settings.kv_staging_min_run:
            return None
        if arena.take(rid, len(blocks) * self._kv_block_bytes) is None:
            return None
        self.counters.staged += 1
        return arena.view(rid)

    def _unstage(self, rid: str) -> None:
        if self.arena is not None:
            self.arena.give_back(rid)

    def _cancel_all(self, pull: _Pull) -> bool:
        """Gives back every read of the pull still held; False if NIXL kept one (it is retried later)."""
        for part, read in list(pull.reads.items()):
            if self.agent.cancel(read):
                del pull.reads[part]
        return not pull.reads

    def _failed(self, pull: _Pull, why: str, events: TransferEvents) -> None:
        """A read that will not land: the prefill side may let go. Its blocks are free again unless NIXL still
        holds a part of it (stuck: they wait until it does not)."""
        rid, source = pull.order.request_id, pull.order.source
        self.counters.pulls_failed += 1
        self.agent.notify(source.agent, b"drop:" + source.handle.encode())
        if self._cancel_all(pull):
            self._unstage(rid)
            events.failed.append((rid, why))
        else:
            self._zombies[rid] = pull
            events.stuck.append((rid, why))

    # ---- the decode side

    def _poll_reads(self, now: float, events: TransferEvents) -> None:
        for rid, pull in list(self._pulls.items()):
            try:
                for part, read in list(pull.reads.items()):
                    if self.agent.done(read):
                        self.agent.cancel(read)
                        del pull.reads[part]
                        pull.seconds[part] = now - pull.started
            except TransferError as exc:
                del self._pulls[rid]
                self._failed(pull, str(exc), events)
                continue
            if not pull.reads:
                del self._pulls[rid]
                self._landed(pull)
                events.landed.append(rid)
            elif now > pull.deadline:
                del self._pulls[rid]
                self._failed(pull, f"no data from it within {self.settings.kv_transfer_timeout:g}s (deadline)", events)
        for rid, pull in list(self._zombies.items()):
            if self._cancel_all(pull):
                del self._zombies[rid]
                self._unstage(rid)
                events.freed.append(rid)

    def _landed(self, pull: _Pull) -> None:
        rid, source = pull.order.request_id, pull.order.source
        if pull.staged:
            assert self.arena is not None
            unpack(self._kv, pull.order.block_ids, self.arena.view(rid))
            self._unstage(rid)
        self.agent.notify(source.agent, b"done:" + source.handle.encode())
        c = self.counters
        c.pulls_done += 1
        c.kv_bytes += pull.nbytes.get("kv", 0)
        c.state_bytes += pull.nbytes.get("state", 0)
        c.kv_seconds += pull.seconds.get("kv", 0.0)
        c.state_seconds += pull.seconds.get("state", 0.0)

    # ---- the prefill side

    def stage(self, outputs: list[EngineCoreOutput]) -> None:
        """Packs the KV of requests the step left held for readers, where fragmented, into the staging arena (the
        outputs then name the span)."""
        packed = False
        for i, out in enumerate(outputs):
            source = out.kv_transfer
            if source is None:
                continue
            span = self._stage(out.request_id, source.block_ids)
            if span is not None:
                assert self.arena is not None
                pack(self._kv, source.block_ids, span)
                packed = True
                offset = span.data_ptr() - self.arena.address
                outputs[i] = msgspec.structs.replace(out, kv_transfer=msgspec.structs.replace(source, staged=offset))
        if packed and self.arena is not None and self.arena.tensor.device.type == "cuda":
            torch.cuda.current_stream(self.arena.tensor.device).synchronize()  # packed before anyone reads

    def _poll_notifications(self, events: TransferEvents) -> None:
        for peer, message in self.agent.notifications():
            kind, _, rid = message.decode(errors="replace").partition(":")
            if kind in ("done", "drop", "keep"):
                events.heard.append((kind, rid))
            else:
                logger.warning("unknown notification %r from %s", message[:80], peer)

    # ---- both

    def poll(self) -> TransferEvents:
        """Once per engine step: a prefill worker hears its readers; a decode worker watches its reads."""
        events = TransferEvents()
        if self.settings.role == "prefill":
            self._poll_notifications(events)
        else:
            self._poll_reads(time.monotonic(), events)
        return events

    @property
    def busy(self) -> bool:
        """Reads in flight, or reads NIXL has not let go: they need polling soon."""
        return bool(self._pulls or self._zombies)

    @property
    def reading(self) -> set[str]:
        """The requests whose reads are in flight or not let go by NIXL."""
        return set(self._pulls) | set(self._zombies)

    def check_integrity(self, held: set[str]) -> None:
        """`held`: the requests the scheduler half holds for readers; the staging spans are theirs or reads'."""
        if self.arena is None:
            return
        self.arena.check_integrity()
        staged = set(self.arena.owners)
        reading = self.reading
        if not staged <= held | reading:
            raise AssertionError(f"staging spans held for {sorted(staged - held - reading)}, neither held nor read")
