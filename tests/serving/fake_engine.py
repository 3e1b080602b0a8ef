"""The HTTP tests' engine: the real `AsyncLLM` (fan-out, detokenization, stop strings, finish reasons, logprob
text) over `ScriptedCore`, an `EngineClient` whose "model" replays scripted token ids.

Engine request i of an add_requests() call (choice i) replays `scripts[i % len(scripts)]`, one token per
step (running requests step together), and a multi-turn test queues one script per call in `turns`: each call
takes the next one for all its requests, and falls back to `scripts` once the queue is empty. As the engine
core does, a request finishes with "stop" on a stop token id (which is its stop_reason) or an EOS id (from
min_tokens on; EOS not with ignore_eos), and with "length" at max_tokens; it also finishes with "stop" when its
script runs out. Stop strings are the frontend's (hybridserve/engine/output_processor.py), as in serving.
Logprobs are synthetic and exact: token at position p has logprob -(p + 1) / 8, and its top list is
[sampled, id+1, id+2, ...] with logprobs lp, lp - 1, lp - 2, ... (binary fractions, so tests compare them with
==). Prompt logprobs follow the same rule, p being the prompt position (the first token's is None).

What tests read (`calls`, `priorities`, `requests`, `aborted`, `completed`, `running`) is counted per engine request, as
the engine core sees them: a request with n choices is n engine requests (ids `<id>-<i>`), and a sequence a
stop string ended is aborted in the engine (the frontend stops it), not completed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.outputs import Logprob, RequestOutput, TopLogprob
from hybridserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    FinishReason,
    SchedulerStats,
    TokenLogprobs,
    WorkerStatus,
)
from hybridserve.sampling_params import SamplingParams

EOS = 2  # SmolLM2's <|im_end|>, which decodes to "" with skip_special_tokens
CRASH = "engine process died"  # the error of a request that `raise_at_step` fails


def token_logprobs(token_id: int, position: int, k: int) -> TokenLogprobs:
    """The scripted model's logprobs of `token_id` at `position`, with k alternatives."""
    lp = -(position + 1) / 8
    return TokenLogprobs(token_id, lp, 1, [(token_id + j, lp - j) for j in range(k)])


@dataclass
class _Run:
    """One engine request being replayed: `step` tokens of `script` emitted so far."""

    request: EngineCoreRequest
    script: list[int]
    index: int  # its place in its add_requests() call (choice index)
    step: int = 0


class ScriptedCore:
    """An EngineClient whose model replays scripts; the knobs below are what tests set (through FakeEngine)."""

    def __init__(self, vocab_size: int, scripts: list[list[int]], max_model_len: int) -> None:
        self._facts = EngineFacts(max_model_len, vocab_size, num_kv_blocks=64, block_size=16)
        self.scripts = scripts
        self.turns: list[list[int]] = []  # one script per add_requests() call, consumed in order, before `scripts`
        self.cached_tokens = 0
        self.error_at_step: int | None = None  # choice 0 ends with finish_reason "error" at this step
        self.raise_at_step: int | None = None  # every request ends with error CRASH at this step (FakeEngine raises)
        self.pause_at_step: int | None = None  # a request waits for `resume` before producing this step
        self.reject: Exception | None = None  # raised by add_requests() before any engine work
        self.dead = False  # the health check fails
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()
        self.calls: list[tuple[list[int], SamplingParams, str]] = []
        self.requests: list[EngineCoreRequest] = []  # every engine request, as it came
        self.priorities: dict[str, int] = {}  # engine request id → the scheduling priority it came with
        self.aborted: list[str] = []
        self.completed: list[str] = []
        self._runs: dict[str, _Run] = {}
        self._work: asyncio.Event | None = None  # set by add_requests; made by the waiting loop

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    @property
    def running(self) -> int:
        return len(self._runs)

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        if self.reject is not None:
            raise self.reject
        scripts = [self.turns.pop(0)] if self.turns else self.scripts
        for index, request in enumerate(requests):
            self.calls.append((request.prompt_token_ids, request.sampling_params, request.request_id))
            self.priorities[request.request_id] = request.priority
            self.requests.append(request)
            self._runs[request.request_id] = _Run(request, scripts[index % len(scripts)], index)
        if self._work is not None:
            self._work.set()

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._runs.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    async def get_outputs(self) -> EngineCoreOutputs:
        """One step of every request not waiting at `pause_at_step`; waits while there is none."""
        while not (ready := [run for run in self._runs.values() if not self._waits(run)]):
            self._work = asyncio.Event()
            waits = [asyncio.ensure_future(self._work.wait()), asyncio.ensure_future(self.resume.wait())]
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
        await asyncio.sleep(0)  # let the consumers of the previous batch run first
        outputs = []
        for run in ready:
            if run.request.request_id not in self._runs:  # aborted while this step waited
                continue
            out = self._step(run)
            outputs.append(out)
            if out.finish_reason is not None:
                del self._runs[run.request.request_id]
                if out.error is None:
                    self.completed.append(run.request.request_id)
        return EngineCoreOutputs(outputs, self.stats())

    def _waits(self, run: _Run) -> bool:
        if run.step != self.pause_at_step or self.resume.is_set():
            return False
        self.paused.set()
        return True

    def _step(self, run: _Run) -> EngineCoreOutput:
        request, params = run.request, run.request.sampling_params
        rid, num_prompt = request.request_id, len(request.prompt_token_ids)
        if run.step == self.raise_at_step:
            return EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=CRASH)
        if run.step == self.error_at_step and run.index == 0:
            return EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error="CUDA error")
        prompt_logprobs = None
        if params.prompt_logprobs is not None and run.step == 0:  # with the first output, as the engine sends them
            k = params.prompt_logprobs
            prompt = request.prompt_token_ids
            prompt_logprobs = [token_logprobs(t, p, k) for p, t in enumerate(prompt[1:], start=1)]
        if params.max_tokens == 0:  # the prompt only: no token
            return EngineCoreOutput(
                rid,
                [],
                None,
                FinishReason.LENGTH,
                None,
                num_prompt,
                self.cached_tokens,
                prompt_logprobs=prompt_logprobs,
            )
        token = run.script[run.step]
        run.step += 1
        finish, stop_reason = self._finish(run, token)
        logprobs = None if params.logprobs is None else [token_logprobs(token, run.step - 1, params.logprobs)]
        return EngineCoreOutput(
            rid, [token], logprobs, finish, stop_reason, num_prompt, self.cached_tokens, prompt_logprobs=prompt_logprobs
        )

    @staticmethod
    def _finish(run: _Run, token: int) -> tuple[FinishReason | None, int | None]:
        """How the request ends after emitting `token` (the engine core's rules, then the script's end)."""
        params = run.request.sampling_params
        if run.step >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
            if token in run.request.eos_token_ids and not params.ignore_eos:
                return FinishReason.STOP, None
        if run.step == len(run.script):
            return FinishReason.STOP, None
        if params.max_tokens is not None and run.step >= params.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.running,
            num_waiting=0,
            kv_cache_usage=self.running / 8,
            prefix_cache_queries=100,
            prefix_cache_hits=25,
            num_preemptions=0,
            num_state_snapshots=3,
            state_snapshot_usage=0.75,
            state_snapshot_hits=2,
        )

    def workers(self) -> list[WorkerStatus]:
        return [WorkerStatus("fake", "down" if self.dead else "up", None, self.stats(), "round_robin")]

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("engine process exited with code 1")

    def shutdown(self) -> None:
        return None


def _core_knob(name: str) -> property:
    """A FakeEngine attribute that reads and sets the scripted core's `name`."""
    return property(lambda self: getattr(self.core, name), lambda self, value: setattr(self.core, name, value))


class FakeEngine(AsyncLLM):
    """The real AsyncLLM over a ScriptedCore. `raise_at_step` makes generate() raise at that step (an engine
    stream that breaks mid-way), as nothing below AsyncLLM can make it raise."""

    scripts = _core_knob("scripts")
    turns = _core_knob("turns")
    cached_tokens = _core_knob("cached_tokens")
    error_at_step = _core_knob("error_at_step")
    raise_at_step = _core_knob("raise_at_step")
    pause_at_step = _core_knob("pause_at_step")
    reject = _core_knob("reject")
    dead = _core_knob("dead")
    paused = _core_knob("paused")
    resume = _core_knob("resume")
    calls = _core_knob("calls")
    priorities = _core_knob("priorities")
    requests = _core_knob("requests")
    aborted = _core_knob("aborted")
    completed = _core_knob("completed")
    running = _core_knob("running")

    def __init__(self, tokenizer, scripts: list[list[int]], *, max_model_len: int = 256) -> None:
        self.core = ScriptedCore(len(tokenizer), scripts, max_model_len)
        # No checkpoint directory: model_type is None ("kimi_k3" serves with the Kimi-K3 extension).
        super().__init__(self.core, tokenizer, "smollm2", [EOS], Path("/nonexistent/scripted-model"))

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        async with contextlib.aclosing(super().generate(prompt_token_ids, params, request_id, priority)) as stream:
            async for out in stream:
                if out.output.error == CRASH:
                    raise RuntimeError(CRASH)
                yield out

    def logprob(self, token_id: int, position: int, k: int) -> Logprob:
        """The Logprob the frontend makes of the scripted model's logprobs of `token_id` at `position`."""
        lp = token_logprobs(token_id, position, k)
        top = [TopLogprob(t, self._text(t), self._bytes(t), value) for t, value in lp.top]
        return Logprob(token_id, self._text(token_id), self._bytes(token_id), lp.logprob, top, rank=1)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        return list(self._text(token_id).encode())
