"""A scripted `ServingEngine` (what AsyncLLM is to the HTTP layer), for testing the HTTP layer exactly.

Every sequence replays `scripts[index % len(scripts)]`, one token per step (sequences interleave), with a
real tokenizer for the text. A multi-turn test queues one script per call in `turns`: each generate() call
takes the next one for all its sequences, and falls back to `scripts` once the queue is empty.
It finishes with "stop" when its script runs out, a stop string appears or a stop token id is emitted, and with
"length" at max_tokens. Logprobs are synthetic and exact:
token at position p has logprob -(p + 1) / 8, and its top list is [sampled, id+1, id+2, ...] with
logprobs lp, lp - 1, lp - 2, ... (binary fractions, so tests compare them with ==). Prompt logprobs follow the
same rule, p being the prompt position (the first token's is None).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hybridserve.engine.outputs import CompletionOutput, Logprob, RequestOutput, TopLogprob
from hybridserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    TokenLogprobs,
    WorkerStatus,
)
from hybridserve.sampling_params import InvalidParameter, SamplingDefaults, SamplingParams


class FakeEngine:
    def __init__(self, tokenizer, scripts: list[list[int]], *, max_model_len: int = 256) -> None:
        self.model_name = "smollm2"
        self.model_type: str | None = None  # "kimi_k3" serves with the Kimi-K3 extension
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scripts = scripts
        self.turns: list[list[int]] = []  # one script per generate() call, consumed in order, before `scripts`
        self.cached_tokens = 0
        self.error_at_step: int | None = None  # sequence 0 ends with finish_reason "error" at this step
        self.raise_at_step: int | None = None  # the iterator raises RuntimeError at this step
        self.pause_at_step: int | None = None  # wait for `resume` before producing this step
        self.reject: Exception | None = None  # raised by generate() before any engine work
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()
        self.calls: list[tuple[list[int], SamplingParams, str]] = []
        self.priorities: dict[str, int] = {}  # request id → the scheduling priority it came with
        self.aborted: list[str] = []
        self.completed: list[str] = []
        self.running = 0
        self.dead = False
        self.eos_token_ids = [2]
        self.sampling_defaults = SamplingDefaults()  # what AsyncLLM reads from generation_config.json
        self._raw: dict[str, asyncio.Task] = {}

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

    def start(self) -> None:
        return None

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("engine process exited with code 1")

    async def add_requests(self, requests: list[EngineCoreRequest], route) -> None:
        """The raw-output path (post-processing workers): the script's tokens as engine outputs, one per step."""
        for request in requests:
            self.calls.append((request.prompt_token_ids, request.sampling_params, request.request_id))
            self.priorities[request.request_id] = request.priority
            self._raw[request.request_id] = asyncio.create_task(self._replay(request, route))

    async def _replay(self, request: EngineCoreRequest, route) -> None:
        script = self.scripts[0]
        max_tokens = request.sampling_params.max_tokens
        self.running += 1
        try:
            for step, token in enumerate(script):
                if step == self.pause_at_step:
                    self.paused.set()
                    await self.resume.wait()
                last = step + 1 == len(script) or token in request.eos_token_ids
                finish = FinishReason.STOP if last else None
                if finish is None and max_tokens is not None and step + 1 >= max_tokens:
                    finish = FinishReason.LENGTH
                if step == self.error_at_step:
                    route(
                        EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR, error="CUDA error")
                    )
                    return
                num_prompt = len(request.prompt_token_ids)
                logprobs = None
                if (k := request.sampling_params.logprobs) is not None:  # the same numbers as logprob() gives
                    lp = -(step + 1) / 8
                    logprobs = [TokenLogprobs(token, lp, 1, [(token + j, lp - j) for j in range(k)])]
                out = EngineCoreOutput(
                    request.request_id, [token], logprobs, finish, None, num_prompt, self.cached_tokens
                )
                route(out)
                if finish is not None:
                    self.completed.append(request.request_id)
                    return
                await asyncio.sleep(0)
        finally:
            self.running -= 1

    def release(self, request_ids: list[str], abort: list[str]) -> None:
        for request_id in request_ids:
            task = self._raw.pop(request_id, None)
            if request_id in abort and task is not None and not task.done():
                task.cancel()
                self.aborted.append(request_id)

    def shutdown(self) -> None:
        pass

    def logprob(self, token_id: int, position: int, k: int) -> Logprob:
        lp = -(position + 1) / 8
        top = [self._top(token_id + j, lp - j) for j in range(k)]
        return Logprob(token_id, self._text(token_id), self._bytes(token_id), lp, top, rank=1)

    def _top(self, token_id: int, lp: float) -> TopLogprob:
        return TopLogprob(token_id, self._text(token_id), self._bytes(token_id), lp)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        return list(self._text(token_id).encode())

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        if self.reject is not None:
            raise self.reject
        self.priorities[request_id] = priority
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidParameter(
                "prompt", f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}"
            )
        self.calls.append((prompt_token_ids, params, request_id))
        self.running += 1
        scripts = [self.turns.pop(0)] if self.turns else self.scripts
        seqs = [_Sequence(scripts[i % len(scripts)]) for i in range(params.n)]
        step = 0
        try:
            while not all(s.finished for s in seqs):
                if step == self.pause_at_step:
                    self.paused.set()
                    await self.resume.wait()
                if step == self.raise_at_step:
                    raise RuntimeError("engine process died")
                for index, seq in enumerate(seqs):
                    if not seq.finished:
                        yield self._step(request_id, prompt_token_ids, params, index, seq, step)
                step += 1
                await asyncio.sleep(0)
            self.completed.append(request_id)
        finally:
            self.running -= 1
            if not all(s.finished for s in seqs):
                self.aborted.append(request_id)

    def _step(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        index: int,
        seq: _Sequence,
        step: int,
    ) -> RequestOutput:
        token = seq.script[len(seq.tokens)] if len(seq.tokens) < len(seq.script) else None
        if step == self.error_at_step and index == 0:
            seq.finished = True
            out = CompletionOutput(index, "", [], None, seq.text, len(seq.tokens), "error", None, "CUDA error")
            return RequestOutput(request_id, len(prompt), self.cached_tokens, out, True)
        prompt_logprobs = None
        if params.prompt_logprobs is not None and not seq.tokens:  # with the first output, as the engine sends them
            k = params.prompt_logprobs
            prompt_logprobs = [None, *(self.logprob(t, p, k) for p, t in enumerate(prompt[1:], start=1))]
        if params.max_tokens == 0:  # the prompt only: no token
            seq.finished = True
            logprobs = None if params.logprobs is None else []
            out = CompletionOutput(index, "", [], logprobs, "", 0, "length", prompt_logprobs=prompt_logprobs)
            return RequestOutput(request_id, len(prompt), self.cached_tokens, out, True)
        seq.tokens.append(token)
        text = self.tokenizer.decode(seq.tokens, skip_special_tokens=params.skip_special_tokens)
        finish, stop_reason = None, None
        for stop in params.stop:
            if stop in text:
                end = text.index(stop) + (len(stop) if params.include_stop_str_in_output else 0)
                text, finish, stop_reason = text[:end], "stop", stop
                break
        if finish is None and token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif finish is None and len(seq.tokens) == len(seq.script):
            finish = "stop"
        elif finish is None and params.max_tokens is not None and len(seq.tokens) >= params.max_tokens:
            finish = "length"
        delta = text[len(seq.text) :]
        seq.text = text
        seq.finished = finish is not None
        logprobs = None if params.logprobs is None else [self.logprob(token, len(seq.tokens) - 1, params.logprobs)]
        out = CompletionOutput(
            index, delta, [token], logprobs, text, len(seq.tokens), finish, stop_reason, prompt_logprobs=prompt_logprobs
        )
        return RequestOutput(request_id, len(prompt), self.cached_tokens, out, seq.finished)


class _Sequence:
    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.tokens: list[int] = []
        self.text = ""
        self.finished = False
