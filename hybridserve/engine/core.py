"""The engine core: one step = schedule → execute → update. Owns the scheduler, cache and model runner."""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import NamedTuple

import msgspec
import torch
import xgrammar as xgr

from hybridserve.config import EngineConfig
from hybridserve.engine.cache.events import KVEventLog
from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.identity import weights_fingerprint
from hybridserve.engine.kv_transfer.connector_scheduler import ConnectorScheduler
from hybridserve.engine.kv_transfer.connector_worker import ConnectorWorker
from hybridserve.engine.kv_transfer.messages import RemotePrefill, TransferEndpoint
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.plan import SchedulerOutput
from hybridserve.engine.prompt_limits import prompt_problem
from hybridserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.structured_output import GrammarBitmask, GrammarCompiler, SequenceGrammar, TokenMask
from hybridserve.engine.throughput_log import ThroughputLog

logger = logging.getLogger("hybridserve.engine")

# With nothing to run but compiles, the loop sleeps on them this long at most, so new messages are seen.
_COMPILE_WAIT_S = 0.01
# With nothing to run but KV reads in flight, the loop checks on them this often.
_PULL_WAIT_S = 0.001


class _Compiling(NamedTuple):
    """A request whose grammar is being compiled; it joins the scheduler once the compile is done."""

    request: Request
    eos_token_ids: list[int]  # the model's EOS ids, which end the grammar even with ignore_eos
    grammar: Future[xgr.CompiledGrammar]


class EngineCore:
    def __init__(self, config: EngineConfig, hf_dir: Path, events: KVEventLog | None = None) -> None:
        """`events`: where the prefix cache reports what it gains and loses (a worker publishes it)."""
        # Requests without a seed draw from the global generators: --seed makes a server's run reproducible.
        torch.manual_seed(config.model.seed)
        if config.parallel.num_threads is not None:
            torch.set_num_threads(config.parallel.num_threads)
        self.runner = ModelRunner(config, hf_dir)
        self.max_model_len = min(config.model.max_model_len or self.runner.max_position, self.runner.max_position)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            self.runner.num_state_slots,
            self.runner.num_state_snapshots,
            events,
        )
        spec = config.scheduler.speculative_config
        reads = math.inf if spec is None else spec.weight_read_tokens
        if reads is None:
            reads = self.runner.weight_read_tokens()
        # Disaggregation: the KV connector's worker half moves bytes here, its scheduler half decides in the
        # scheduler.
        self.connector: ConnectorWorker | None = None
        deciding: ConnectorScheduler | None = None
        if config.transfer.role != "both":
            runner = self.runner
            weights = weights_fingerprint(hf_dir)
            self.connector = ConnectorWorker(config.transfer, runner.layout, runner.kv_caches, runner.device, weights)
            layout = runner.layout
            agent = self.connector.endpoint.agent
            deciding = ConnectorScheduler(config.transfer, agent, layout.bytes_per_block, layout.bytes_per_state_slot)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.runner.device.type, reads, deciding)
        self.grammar_bitmask = GrammarBitmask(self.runner.vocab_size)
        self._pending: list[EngineCoreOutput] = []
        self.grammars = GrammarCompiler(hf_dir, self.runner.vocab_size)
        self._compiling: dict[str, _Compiling] = {}
        self.throughput = ThroughputLog()

    def add_request(self, core: EngineCoreRequest) -> None:
        error = self._validate(core)
        if error is not None:
            self._pending.append(
                EngineCoreOutput(
                    core.request_id,
                    [],
                    finish_reason=FinishReason.ERROR,
                    num_prompt_tokens=len(core.prompt_token_ids),
                    error=error,
                )
            )
            return
        req = Request(core, self.max_model_len)
        spec = core.sampling_params.structured_output
        if spec is None:
            self.scheduler.add(req)
        else:
            self._compiling[req.request_id] = _Compiling(req, core.eos_token_ids, self.grammars.submit(spec))

    def _validate(self, core: EngineCoreRequest) -> str | None:
        n = len(core.prompt_token_ids)
        if core.request_id in self.scheduler.requests or core.request_id in self._compiling:
            return f"request id {core.request_id!r} is already in use"
        if (problem := prompt_problem(n, self.max_model_len)) is not None:
            return problem
        transfer = core.kv_transfer
        if transfer is not None and self.connector is None:
            return "this worker does not take part in disaggregation (--role both)"
        if isinstance(transfer, RemotePrefill) and self.connector is not None:
            if (problem := self.connector.check(transfer.source)) is not None:
                return problem
            if (transfer.source.state_slot >= 0) != (self.kv.states is not None):
                return f"state slot {transfer.source.state_slot} does not fit this model's recurrent state"
            if transfer.source.num_tokens != n:
                return f"the transfer covers {transfer.source.num_tokens} tokens but the prompt has {n}"
        bad = [t for t in core.prompt_token_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            return f"prompt token id {bad[0]} is outside the vocabulary (size {self.runner.vocab_size})"
        needed = -(-(n + 1) // self.kv.block_size)
        if needed > self.kv.pool.num_blocks:
            return f"prompt of {n} tokens needs {needed} KV blocks but the cache has {self.kv.pool.num_blocks}"
        return None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            compiling = self._compiling.pop(rid, None)
            if compiling is not None:
                compiling.request.finish(FinishReason.ABORT)
                self._pending.append(compiling.request.output([]))
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            if req.pull_from is not None and self.connector is not None:
                assert self.scheduler.connector is not None
                if not self.scheduler.connector.drop(req):
                    continue  # its read failed and its client heard; its blocks wait for NIXL
                self._pending += self._flush_transfer_orders()  # the read cancelled, if it can be at once
                if req.status is RequestStatus.PULLING:
                    self._pending.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT))
                    continue  # it keeps its blocks until NIXL lets its read go
            held = req.status is RequestStatus.HELD  # its client moved on to the decode worker: nobody to tell
            if req.status is not RequestStatus.FINISHED:  # (a cancelled read finished it)
                self.scheduler.finish(req, FinishReason.ABORT)
            if not held:
                self._pending.append(req.output([]))
        if self.connector is not None:
            self._pending += self._flush_transfer_orders()  # held requests let go: their spans too

    def add_transfer_peer(self, endpoint: TransferEndpoint) -> None:
        """A prefill worker this decode worker may be asked to read from (the frontend introduces it)."""
        if self.connector is not None and self.connector.add_peer(endpoint):
            assert self.scheduler.connector is not None
            self.scheduler.connector.meet(endpoint.agent, endpoint.lease_s)

    def _flush_transfer_orders(self) -> list[EngineCoreOutput]:
        """Orders the connector's scheduler half made outside a step's plan go to its worker half at once."""
        assert self.connector is not None and self.scheduler.connector is not None
        outputs: list[EngineCoreOutput] = []
        while orders := self.scheduler.connector.take_orders():
            if events := self.connector.execute(orders):
                outputs += self.scheduler.transfer_update(events)
        return outputs

    @property
    def held_for_readers(self) -> set[str]:
        """The requests this prefill worker holds for decode workers to read."""
        return set(self.scheduler.connector.held) if self.scheduler.connector is not None else set()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or bool(self._compiling)

    @property
    def watching_transfers(self) -> bool:
        """Held requests or reads need a look now and then even with nothing to run (acknowledgements, leases)."""
        if self.connector is None or self.scheduler.connector is None:
            return False
        return self.connector.busy or self.scheduler.connector.busy

    def step(self) -> EngineCoreOutputs:
        outputs, self._pending = self._pending, []
        if self.connector is not None:
            outputs.extend(self.scheduler.transfer_update(self.connector.poll()))
        if self._compiling:
            outputs.extend(self._admit_compiled())
        if self.scheduler.has_work():
            outputs.extend(self._step())
        elif self._compiling:  # nothing to run until a compile finishes
            wait([c.grammar for c in self._compiling.values()], _COMPILE_WAIT_S, FIRST_COMPLETED)
        if self.connector is not None:
            outputs.extend(self._flush_transfer_orders())
        stats = self.stats()
        self.throughput.maybe_log(stats)
        return EngineCoreOutputs(outputs, stats)

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.connector is None or self.scheduler.connector is None:
            return stats
        c = self.connector.counters
        return msgspec.structs.replace(
            stats,
            kv_pulls_done=c.pulls_done,
            kv_pulls_failed=c.pulls_failed,
            kv_leases_expired=self.scheduler.connector.leases_expired,
            kv_staged=c.staged,
            kv_pulled_kv_bytes=c.kv_bytes,
            kv_pulled_state_bytes=c.state_bytes,
            kv_pull_kv_seconds=c.kv_seconds,
            kv_pull_state_seconds=c.state_seconds,
        )

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar is compiled to the scheduler (in arrival order); fail those whose
        compile failed (the frontend checks specs first, so that means a bad spec from another client)."""
        failed: list[EngineCoreOutput] = []
        for rid, (req, eos_ids, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                req.grammar = SequenceGrammar(future.result(), eos_ids)  # result() re-raises the compile's error
                if not all(req.grammar.accept(t) for t in req.output_token_ids):  # sampled by a prefill worker
                    raise ValueError(f"its first tokens {req.output_token_ids} do not fit the grammar")
            except Exception as exc:  # reported on this request only; the others go on
                logger.warning("request %s: structured_output could not be compiled: %s", rid, exc)
                req.finish(FinishReason.ERROR)
                failed.append(req.output([], error=f"structured_output could not be compiled: {exc}"))
                continue
            self.scheduler.add(req)
        return failed

    def _step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        started: list[EngineCoreOutput] = []
        transfer = plan.kv_transfer
        # Admitted reads start here and run on NIXL's thread while this step computes.
        if transfer is not None and self.connector is not None and (events := self.connector.execute(transfer)):
            started = self.scheduler.transfer_update(events)
        hidden = self.runner.forward(plan)  # also a plan with nothing scheduled: it may finish requests
        if not plan.scheduled:
            # Blocks and state slots held for a decode worker or being filled by a read come back by themselves
            # (read, failed, or the lease ends); a read that failed at once may have queued a recompute.
            connector = self.scheduler.connector
            if (connector is not None and (connector.pulling or connector.held)) or (transfer and transfer.pulls):
                time.sleep(_PULL_WAIT_S)
                return started
            return started + self._fail_unschedulable()
        # Filled on the CPU while a GPU still runs the step's kernels.
        mask = self._grammar_mask(plan)
        sampled = self.runner.sample(plan, hidden, mask)
        outputs = self.scheduler.update(plan, sampled)
        if self.connector is not None:
            self.connector.stage(outputs)
        generated = sum(len(out.new_token_ids) for out in outputs)  # several per request with speculative decoding
        self.throughput.record(plan.num_tokens, generated, time.perf_counter() - start)
        return started + outputs

    def _grammar_mask(self, plan: SchedulerOutput) -> TokenMask | None:
        """The allowed tokens of the constrained requests that sample this step (rows as plan.sampling_ids)."""
        ids = plan.sampling_ids
        rows = [(row, g) for row, rid in enumerate(ids) if (g := self.scheduler.requests[rid].grammar) is not None]
        return self.grammar_bitmask.fill(rows, len(ids), self.runner.device) if rows else None

    def _fail_unschedulable(self) -> list[EngineCoreOutput]:
        """Nothing could run with nothing running nor held: the head of the queue cannot fit even in an empty
        cache (a request that grew past it while decoding)."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        req = self.scheduler.waiting[0]
        n, blocks = req.num_tokens, -(-req.num_tokens // self.kv.block_size)
        msg = f"request needs {blocks} KV blocks for its {n} tokens; the cache holds {self.kv.pool.num_blocks}"
        logger.error("request %s: %s", req.request_id, msg)
        return [self.scheduler.fail(req, msg)]

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """After a failed step: end every request the scheduler holds with an error (those still waiting for
        their grammar took no part in the step and go on)."""
        return self.scheduler.fail_all(error)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        self.runner.check_integrity()
        unknown = set(self.runner.requests) - set(self.scheduler.requests) - set(self.scheduler.finished_ids)
        if unknown:
            raise AssertionError(f"the runner keeps state of requests {sorted(unknown)} the scheduler does not hold")
        live = {r.request_id for r in self.scheduler.running}
        if self.connector is not None and (deciding := self.scheduler.connector) is not None:
            deciding.check_integrity()
            self.connector.check_integrity(set(deciding.held))
            if not self.connector.reading <= set(deciding.pulling):
                raise AssertionError(f"reads {sorted(self.connector.reading - set(deciding.pulling))} of no pull")
            live |= set(deciding.held) | set(deciding.pulling)
        running_blocks = set(self.kv.req_blocks)
        if running_blocks != live:
            raise AssertionError(f"requests holding blocks {sorted(running_blocks)} != running {sorted(live)}")
