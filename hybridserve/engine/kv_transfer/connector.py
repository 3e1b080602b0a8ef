"""Disaggregation inside one engine core: the prefill half (hold what was prefilled under a lease, release it
when the reader is done) and the decode half (read into the blocks and state slot the scheduler admitted,
bounded by a deadline and by the bytes in flight; on failure fail the request or prefill it here).

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
from hybridserve.engine.kv_transfer.leases import Leases
from hybridserve.engine.kv_transfer.messages import TransferEndpoint, TransferSource
from hybridserve.engine.protocol import EngineCoreOutput, FinishReason
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler
from hybridserve.models.cache_specs import CacheLayout

logger = logging.getLogger("hybridserve.kv_transfer")


@dataclass
class _Pull:
    """A request's read: its KV part and (hybrid models) its state part, each one NIXL read, timed apart."""

    request: Request
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
    leases_expired: int = 0
    staged: int = 0  # requests whose KV this side packed into (or scattered from) its staging arena
    refused_peers: dict[str, str] = field(default_factory=dict)  # agent → why it cannot be read from


class KVConnector:
    def __init__(
        self,
        settings: TransferConfig,
        layout: CacheLayout,
        caches: list[object],
        device: torch.device,
        weights: str,
        scheduler: Scheduler,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
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
        self.leases = Leases(settings.kv_lease)
        self.peers: dict[str, TransferEndpoint] = {}
        self.counters = TransferCounters()
        self._pulls: dict[str, _Pull] = {}  # reads in flight, by request id
        self._zombies: dict[str, _Pull] = {}  # ended reads NIXL would not release yet: their blocks wait
        self._kept: dict[str, float] = {}  # waiting readers: when the prefill side last heard `keep`
        self._block_bytes = layout.bytes_per_block
        self._state_bytes = layout.bytes_per_state_slot
        scheduler.pull_gate = self._has_room
        scheduler.transfer_agent = name

    # ---- first contact

    def add_peer(self, endpoint: TransferEndpoint) -> None:
        """A prefill worker this one may read from: checked against our layout once, the answer remembered."""
        if endpoint.agent in self.peers or endpoint.agent in self.counters.refused_peers:
            return
        problem = mismatch(self.endpoint, endpoint)
        if problem is None:
            try:
                self.agent.add_peer(endpoint.metadata)
            except Exception as exc:  # metadata NIXL cannot use: as incompatible as a wrong layout
                problem = f"NIXL refused its metadata: {type(exc).__name__}: {exc}"
        if problem is not None:
            logger.warning("prefill worker %s cannot be read from: %s", endpoint.agent, problem)
            self.counters.refused_peers[endpoint.agent] = problem
            return
        self.peers[endpoint.agent] = endpoint

    def check(self, source: TransferSource) -> str | None:
        """Why a request reading from `source` cannot be served here (None: it can)."""
        if (problem := self.counters.refused_peers.get(source.agent)) is not None:
            return f"prefill worker {source.agent} is incompatible with this decode worker: {problem}"
        if source.agent not in self.peers:
            return f"prefill worker {source.agent} is unknown here (the frontend did not introduce it)"
        if (source.state_slot >= 0) != (self.scheduler.kv.states is not None):
            return f"state slot {source.state_slot} does not fit this model's recurrent state"
        return None

    # ---- the decode half

    def _bytes(self, req: Request) -> int:
        source = req.pull_from
        assert source is not None
        return len(source.block_ids) * self._block_bytes + (self._state_bytes if source.state_slot >= 0 else 0)

    def _has_room(self, req: Request) -> bool:
        inflight = sum(self._bytes(p.request) for p in self._pulls.values())
        return not self._pulls or inflight + self._bytes(req) <= self.settings.kv_transfer_max_bytes

    def start(self, requests: list[Request], now: float) -> list[EngineCoreOutput]:
        """Starts the reads of requests the scheduler just admitted into their blocks and slots."""
        failed: list[EngineCoreOutput] = []
        kv = self.scheduler.kv
        for req in requests:
            source = req.pull_from
            assert source is not None
            rid = req.request_id
            self._kept.pop(rid, None)
            peer = self.peers[source.agent]
            blocks = (source.block_ids, kv.block_ids(rid)[: len(source.block_ids)])
            slots = (source.state_slot, kv.state_slot(rid)) if source.state_slot >= 0 else None
            theirs = peer.arena + source.staged if source.staged >= 0 else None
            ours = self._stage(rid, blocks[1])
            staged = (theirs, ours.data_ptr() if ours is not None else None)
            parts = read_descriptors(self.endpoint.tensors, peer.tensors, blocks, slots, staged)
            pull = _Pull(req, now, now + self.settings.kv_transfer_timeout, {}, {p: d.nbytes for p, d in parts.items()})
            pull.staged = ours is not None
            try:
                for part, d in parts.items():
                    pull.reads[part] = self.agent.read(source.agent, d.local, d.remote)
            except TransferError as exc:
                self._cancel_all(pull)
                self._unstage(rid)
                failed.extend(self._failed(req, str(exc)))
                continue
            self._pulls[rid] = pull
        return failed

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

    def _failed(self, req: Request, why: str) -> list[EngineCoreOutput]:
        """A read that will not land: the prefill side may let go, and the request fails or is prefilled here."""
        source = req.pull_from
        assert source is not None
        self.counters.pulls_failed += 1
        self.agent.notify(source.agent, b"drop:" + source.handle.encode())
        if self.settings.kv_transfer_failure == "recompute":
            logger.warning("request %s: KV transfer failed (%s); prefilling it here instead", req.request_id, why)
            self.scheduler.prefill_locally(req)
            return []
        logger.warning("request %s: KV transfer failed: %s", req.request_id, why)
        return [self.scheduler.fail(req, f"KV transfer from prefill worker {source.agent} failed: {why}")]

    def abort(self, req: Request) -> bool:
        """The request ends while its read may be in flight: cancel the read and tell the prefill side. False
        when NIXL would not release the read yet: the request keeps its blocks until it does."""
        source = req.pull_from
        assert source is not None
        self._kept.pop(req.request_id, None)
        self.agent.notify(source.agent, b"drop:" + source.handle.encode())
        pull = self._pulls.pop(req.request_id, None)
        if pull is None or self._cancel_all(pull):
            self._unstage(req.request_id)
            return True
        self._zombies[req.request_id] = pull
        return False

    def _poll_reads(self, now: float) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for rid, pull in list(self._pulls.items()):
            req, source = pull.request, pull.request.pull_from
            assert source is not None
            try:
                for part, read in list(pull.reads.items()):
                    if self.agent.done(read):
                        self.agent.cancel(read)
                        del pull.reads[part]
                        pull.seconds[part] = now - pull.started
            except TransferError as exc:
                del self._pulls[rid]
                if self._cancel_all(pull):
                    self._unstage(rid)
                    outputs += self._failed(req, str(exc))
                else:
                    outputs += self._zombie(rid, pull, str(exc))
                continue
            if not pull.reads:
                del self._pulls[rid]
                if pull.staged:
                    assert self.arena is not None
                    unpack(self._kv, self.scheduler.kv.block_ids(rid)[: len(source.block_ids)], self.arena.view(rid))
                    self._unstage(rid)
                self.agent.notify(source.agent, b"done:" + source.handle.encode())
                c = self.counters
                c.pulls_done += 1
                c.kv_bytes += pull.nbytes.get("kv", 0)
                c.state_bytes += pull.nbytes.get("state", 0)
                c.kv_seconds += pull.seconds.get("kv", 0.0)
                c.state_seconds += pull.seconds.get("state", 0.0)
                self.scheduler.landed(req)
            elif now > pull.deadline:
                del self._pulls[rid]
                why = f"no data from it within {self.settings.kv_transfer_timeout:g}s (deadline)"
                if self._cancel_all(pull):
                    self._unstage(rid)
                    outputs += self._failed(req, why)
                else:
                    outputs += self._zombie(rid, pull, why)
        for rid, pull in list(self._zombies.items()):
            if self._cancel_all(pull):
                del self._zombies[rid]
                self._unstage(rid)
                self.scheduler.finish(pull.request, FinishReason.ABORT)  # its client heard already
        return outputs

    def _zombie(self, rid: str, pull: _Pull, why: str) -> list[EngineCoreOutput]:
        """The request ends now; its blocks wait until NIXL lets its reads go."""
        self._zombies[rid] = pull
        self.counters.pulls_failed += 1
        source = pull.request.pull_from
        assert source is not None
        self.agent.notify(source.agent, b"drop:" + source.handle.encode())
        error = f"KV transfer from prefill worker {source.agent} failed: {why}"
        return [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=error)]

    def _keep_waiting_leases(self, now: float) -> None:
        """Readers still queued for room ask their prefill workers to hold on (every third of the lease)."""
        for req in self.scheduler.waiting:
            source = req.pull_from
            if source is None:
                continue
            peer = self.peers.get(source.agent)
            last = self._kept.setdefault(req.request_id, now)
            if peer is not None and now - last >= peer.lease_s / 3:
                self.agent.notify(source.agent, b"keep:" + source.handle.encode())
                self._kept[req.request_id] = now

    # ---- the prefill half

    def hold(self, outputs: list[EngineCoreOutput], now: float) -> None:
        """Leases what the step prefilled for remote decode, packing fragmented requests' KV (the outputs then
        name the span)."""
        packed = False
        for i, out in enumerate(outputs):
            source = out.kv_transfer
            if source is None:
                continue
            self.leases.hold(out.request_id, now)
            span = self._stage(out.request_id, source.block_ids)
            if span is not None:
                assert self.arena is not None
                pack(self._kv, source.block_ids, span)
                packed = True
                offset = span.data_ptr() - self.arena.address
                outputs[i] = msgspec.structs.replace(out, kv_transfer=msgspec.structs.replace(source, staged=offset))
        if packed and self.arena is not None and self.arena.tensor.device.type == "cuda":
            torch.cuda.current_stream(self.arena.tensor.device).synchronize()  # packed before anyone reads

    def release(self, request_id: str) -> bool:
        """A held request's reader is done, gave up, or its frontend dropped it: its lease and span go."""
        self._unstage(request_id)
        return self.leases.release(request_id)

    def _poll_notifications(self, now: float) -> None:
        for peer, message in self.agent.notifications():
            kind, _, rid = message.decode(errors="replace").partition(":")
            if kind in ("done", "drop"):
                if self.release(rid):
                    self.scheduler.release_held(rid)
            elif kind == "keep":
                self.leases.extend(rid, now)
            else:
                logger.warning("unknown notification %r from %s", message[:80], peer)
        for rid in self.leases.expired(now):
            self._unstage(rid)
            self.counters.leases_expired += 1
            logger.warning(
                "request %s: no decode worker read it within %gs; its blocks go back", rid, self.leases.lease_s
            )
            self.scheduler.release_held(rid)

    # ---- both

    def poll(self) -> list[EngineCoreOutput]:
        """Once per engine step: a prefill worker hears its readers and ends leases; a decode worker watches its
        reads and keeps the leases of the readers still queued."""
        now = time.monotonic()
        if self.settings.role == "prefill":
            self._poll_notifications(now)
            return []
        outputs = self._poll_reads(now)
        self._keep_waiting_leases(now)
        return outputs

    @property
    def busy(self) -> bool:
        """Something here needs polling soon: reads in flight, held requests, or reads NIXL has not let go."""
        return bool(self._pulls or self._zombies or len(self.leases))

    def check_integrity(self) -> None:
        held = set(self.scheduler.held)
        leased = {rid for rid in held if rid in self.leases}
        if held != leased or len(self.leases) != len(held):
            raise AssertionError(f"held requests {sorted(held)} != leased {len(self.leases)}")
        reading = set(self._pulls) | set(self._zombies)
        if not reading <= set(self.scheduler.pulling):
            raise AssertionError(f"reads {sorted(reading - set(self.scheduler.pulling))} for requests not pulling")
        if self.arena is not None:
            self.arena.check_integrity()
            staged = set(self.arena.owners)
            if not staged <= held | reading:
                raise AssertionError(f"staging spans held for {sorted(staged - held - reading)}, neither held nor read")
