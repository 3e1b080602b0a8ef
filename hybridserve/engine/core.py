"""The engine core: one step = schedule → execute → update. Owns the scheduler, cache and model runner."""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import NamedTuple

import torch
import xgrammar as xgr

from hybridserve.config import EngineConfig
from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.prompt_limits import prompt_problem
from hybridserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.structured_output import GrammarCompiler, SequenceGrammar
from hybridserve.engine.throughput_log import ThroughputLog

logger = logging.getLogger("hybridserve.engine")

# With nothing to run but compiles, the loop sleeps on them this long at most, so new messages are seen.
_COMPILE_WAIT_S = 0.01


class _Compiling(NamedTuple):
    """A request whose grammar is being compiled; it joins the scheduler once the compile is done."""

    request: Request
    eos_token_ids: list[int]  # the model's EOS ids, which end the grammar even with ignore_eos
    grammar: Future[xgr.CompiledGrammar]


class EngineCore:
    def __init__(self, config: EngineConfig, hf_dir: Path) -> None:
        # Requests without a seed draw from the global generators: --seed makes a server's run reproducible.
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, hf_dir)
        self.max_model_len = min(config.max_model_len or self.runner.max_position, self.runner.max_position)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.runner.state_pool,
            self.runner.snapshots,
        )
        self.scheduler = Scheduler(config, self.kv, self.runner.device.type)
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
                self._pending.append(self._output(compiling.request, []))
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish(req, FinishReason.ABORT)
                self.runner.release(rid)
                self._pending.append(self._output(req, []))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or bool(self._compiling)

    def step(self) -> EngineCoreOutputs:
        outputs, self._pending = self._pending, []
        if self._compiling:
            outputs.extend(self._admit_compiled())
        if self.scheduler.has_work():
            outputs.extend(self._step())
        elif self._compiling:  # nothing to run until a compile finishes
            wait([c.grammar for c in self._compiling.values()], _COMPILE_WAIT_S, FIRST_COMPLETED)
        stats = self.scheduler.stats()
        self.throughput.maybe_log(stats)
        return EngineCoreOutputs(outputs, stats)

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
            except Exception as exc:  # reported on this request only; the others go on
                logger.warning("request %s: structured_output could not be compiled: %s", rid, exc)
                req.finish(FinishReason.ERROR)
                failed.append(self._output(req, [], error=f"structured_output could not be compiled: {exc}"))
                continue
            self.scheduler.add(req)
        return failed

    def _step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return self._fail_unschedulable()
        tables = [self.kv.block_ids(s.request.request_id) for s in plan.scheduled]
        slots = None
        if self.kv.states is not None:
            slots = [self.kv.state_slot(s.request.request_id) for s in plan.scheduled]
        sampled = self.runner.execute(plan, tables, slots)
        self.scheduler.complete_step(plan)
        outputs = []
        for s in plan.scheduled:
            req = s.request
            result = sampled.get(req.request_id)
            if result is None:
                continue
            req.output_token_ids.append(result.token_id)
            if req.grammar is not None and not req.grammar.accept(result.token_id):  # the mask forbids this
                outputs.append(self._fail(req, f"grammar rejected sampled token {result.token_id}"))
                continue
            req.check_stop()
            logprobs = [result.logprobs] if result.logprobs is not None else None
            outputs.append(self._output(req, [result.token_id], logprobs))
            if req.status is RequestStatus.FINISHED:
                self.runner.release(req.request_id)
        self.scheduler.retire_finished()
        self.throughput.record(plan.num_tokens, len(sampled), time.perf_counter() - start)
        return outputs

    def _fail_unschedulable(self) -> list[EngineCoreOutput]:
        """Nothing could run: the head of the queue cannot fit even in an empty cache."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        req = self.scheduler.waiting[0]
        msg = f"request needs {req.num_tokens} tokens of KV cache; the cache holds {self.kv.pool.num_blocks} blocks"
        logger.error("request %s: %s", req.request_id, msg)
        return [self._fail(req, msg)]

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """After a failed step: end every request the scheduler holds with an error (those still waiting for
        their grammar took no part in the step and go on). Blocks of that step were made findable before
        their KV was written, so the prefix cache is forgotten too."""
        failed = [self._fail(req, error) for req in list(self.scheduler.requests.values())]
        self.kv.pool.reset_prefix_cache()
        return failed

    def _fail(self, req: Request, error: str) -> EngineCoreOutput:
        self.scheduler.finish(req, FinishReason.ERROR)
        self.runner.release(req.request_id)
        return self._output(req, [], error=error)

    @staticmethod
    def _output(
        req: Request, new_ids: list[int], logprobs: list | None = None, error: str | None = None
    ) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_logprobs=logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            error=error,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        running_blocks = set(self.kv.req_blocks)
        live = {r.request_id for r in self.scheduler.running}
        if running_blocks != live:
            raise AssertionError(f"requests holding blocks {sorted(running_blocks)} != running {sorted(live)}")
