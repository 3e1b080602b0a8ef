"""The asyncio front of an engine worker, used by the HTTP server.

It owns the tokenizer-side work of a request (stop strings, detokenization, logprob text) and the
fan-out of n choices; the worker sees only token ids. One background task reads the worker's outputs
and routes them to per-request queues.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from hybridserve.config import EngineConfig
from hybridserve.engine.client import ProcessEngineClient
from hybridserve.engine.fanout import expand
from hybridserve.engine.output_processor import SequenceOutput
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.protocol import EngineCoreOutput, SchedulerStats
from hybridserve.models.loader import resolve_model
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import load_tokenizer

logger = logging.getLogger("hybridserve.engine")


def eos_token_ids(hf_dir: Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end generation: generation_config.json's eos_token_id(s) and the tokenizer's."""
    ids: list[int] = []
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


class AsyncLLM:
    def __init__(
        self, client: ProcessEngineClient, tokenizer: PreTrainedTokenizerBase, model_name: str, eos_ids: list[int]
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = client.ready.max_model_len
        self.eos_token_ids = eos_ids
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        self._stats = SchedulerStats()
        self._reader: asyncio.Task[None] | None = None
        self._dead: str | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        resolved = resolve_model(config.model)
        tokenizer = load_tokenizer(resolved.hf_dir)
        client = ProcessEngineClient(config, resolved.hf_dir)
        return cls(
            client, tokenizer, config.served_model_name or resolved.name, eos_token_ids(resolved.hf_dir, tokenizer)
        )

    def stats(self) -> SchedulerStats:
        return self._stats

    async def check_health(self) -> None:
        if self._dead is not None or not self.client.is_alive():
            raise RuntimeError(f"engine worker is not running: {self._dead or 'process exited'}")

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        try:
            while True:
                batch = await self.client.get_outputs()
                if batch.stats is not None:
                    self._stats = batch.stats
                for out in batch.outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as exc:  # the worker died: fail every waiting request, loudly
            self._dead = str(exc)
            logger.exception("engine output reader stopped")
            for rid, queue in self._queues.items():
                queue.put_nowait(EngineCoreOutput(rid, [], finish_reason="error", error=self._dead))

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield updates of every choice until all n have finished. Closing the iterator early aborts
        whatever is still running in the engine."""
        children = expand(request_id, prompt_token_ids, params, self.eos_token_ids, self.max_model_len)
        await self.check_health()
        self._ensure_reader()
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        seqs = {c.request_id: SequenceOutput(self.tokenizer, c, i) for i, c in enumerate(children)}
        for rid in seqs:
            self._queues[rid] = queue
        try:
            for child in children:
                self.client.add_request(child)
            remaining = len(seqs)
            while remaining:
                out = await queue.get()
                seq = seqs[out.request_id]
                if seq.finished:
                    continue
                update = seq.update(out)
                if seq.stopped_by_string:
                    self.client.abort([out.request_id])
                if seq.finished:
                    remaining -= 1
                if update is not None:
                    yield RequestOutput(request_id, out.num_prompt_tokens, out.num_cached_tokens, update, seq.finished)
        finally:
            unfinished = [rid for rid, seq in seqs.items() if not seq.finished]
            for rid in seqs:
                self._queues.pop(rid, None)
            if unfinished:
                self.client.abort(unfinished)

    async def abort(self, request_id: str) -> None:
        """Abort a request by the id given to generate (all of its choices)."""
        ids = [rid for rid in self._queues if rid == request_id or rid.startswith(f"{request_id}-")]
        if ids:
            self.client.abort(ids)

    def shutdown(self) -> None:
        """Stop the worker. Safe after the event loop has closed (the reader task dies with it)."""
        try:
            if self._reader is not None and not self._reader.get_loop().is_closed():
                self._reader.cancel()
        finally:
            self.client.shutdown()
