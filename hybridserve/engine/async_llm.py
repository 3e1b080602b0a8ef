"""The asyncio front of an engine (any EngineClient: in-process, a worker process), used by the HTTP server.

It owns the tokenizer-side work of a request (stop strings, detokenization, logprob text) and the
fan-out of n choices; the engine sees only token ids. One background task reads the engine's outputs
and routes them to per-request queues.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridserve.engine.client import EngineClient
from hybridserve.engine.fanout import expand
from hybridserve.engine.output_processor import ChoiceOutputs
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    WorkerStatus,
)
from hybridserve.sampling_params import InvalidParameter, SamplingDefaults, SamplingParams

logger = logging.getLogger("hybridserve.engine")
GENERATION_CONFIG = "generation_config.json"


def generation_config(hf_dir: Path) -> dict[str, Any]:
    """The checkpoint's generation_config.json ({} without one)."""
    path = hf_dir / GENERATION_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def eos_token_ids(hf_dir: Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end generation: generation_config.json's eos_token_id(s) and the tokenizer's."""
    ids: list[int] = []
    eos = generation_config(hf_dir).get("eos_token_id")
    ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def sampling_defaults(hf_dir: Path, source: str = "auto") -> SamplingDefaults:
    """What requests that leave out sampling fields sample with (`--generation-config`): "auto": the fields of
    SamplingDefaults that generation_config.json sets (vLLM reads the same ones and, like it, ignores
    `do_sample`), OpenAI's neutral values for the rest; "none": OpenAI's neutral values only."""
    if source == "none":
        return SamplingDefaults()
    config = generation_config(hf_dir)
    names = [f.name for f in dataclasses.fields(SamplingDefaults)]
    try:
        return SamplingDefaults(**{name: config[name] for name in names if config.get(name) is not None})
    except InvalidParameter as exc:
        raise ValueError(f"{hf_dir / GENERATION_CONFIG}: {exc}") from None


def model_type(hf_dir: Path) -> str | None:
    """The checkpoint's config.json `model_type` (None without one): it chooses the serving extension."""
    config = hf_dir / "config.json"
    value = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return value if isinstance(value, str) else None


class AsyncLLM:
    """The frontend of any EngineClient: one reader task routes the engine's outputs by request id."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        eos_ids: list[int],
        hf_dir: Path,
        defaults: SamplingDefaults | None = None,
    ) -> None:
        self.client = client
        self.hf_dir = hf_dir  # the tokenizer's files, for processes that load their own
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = client.facts.max_model_len
        self.eos_token_ids = eos_ids
        self.model_type = model_type(hf_dir)
        self.sampling_defaults = SamplingDefaults() if defaults is None else defaults
        self._routes: dict[str, Callable[[EngineCoreOutput], None]] = {}  # engine request id → its reader
        self._reader: asyncio.Task[None] | None = None
        self._dead: str | None = None

    def stats(self) -> SchedulerStats:
        return self.client.stats()

    def workers(self) -> list[WorkerStatus]:
        return self.client.workers()

    def start(self) -> None:
        """Starts reading the engine's outputs (and, with it, the router's heartbeats) before any request."""
        self._ensure_reader()

    async def check_health(self) -> None:
        if self._dead is not None:
            raise RuntimeError(f"engine worker is not running: {self._dead}")
        await self.client.check_health()

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        try:
            while True:
                batch = await self.client.get_outputs()
                for out in batch.outputs:
                    route = self._routes.get(out.request_id)
                    if route is not None:
                        route(out)
        except Exception as exc:  # the engine is gone: fail every waiting request, loudly
            self._dead = str(exc)
            logger.exception("engine output reader stopped")
            for rid, route in list(self._routes.items()):
                route(EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=self._dead))

    async def add_requests(self, requests: list[EngineCoreRequest], route: Callable[[EngineCoreOutput], None]) -> None:
        """Runs engine requests whose raw outputs go to `route` until `release`. An engine failure reaches
        `route` as an output with finish reason error. Both generate() and post-processing workers (which
        turn raw outputs into text themselves) enter the engine here."""
        await self.check_health()
        self._ensure_reader()
        for request in requests:
            self._routes[request.request_id] = route
        try:
            await self.client.add_requests(requests)
        except BaseException:
            for request in requests:
                self._routes.pop(request.request_id, None)
            raise

    def release(self, request_ids: list[str], abort: list[str]) -> None:
        """Stops routing these requests' outputs; the engine also stops its work on those in `abort`."""
        for rid in request_ids:
            self._routes.pop(rid, None)
        if abort:
            self.client.abort(abort)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Yield updates of every choice until all n have finished. Closing the iterator early aborts
        whatever is still running in the engine. `priority`: lower is scheduled first (online traffic 0)."""
        children = expand(request_id, prompt_token_ids, params, self.eos_token_ids, self.max_model_len, priority)
        choices = ChoiceOutputs(self.tokenizer, children, self.client.abort)
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        await self.add_requests(children, queue.put_nowait)
        try:
            while not choices.done:
                out = await queue.get()
                update = choices.feed(out)
                if update is not None:
                    finished = update.finish_reason is not None
                    yield RequestOutput(request_id, out.num_prompt_tokens, out.num_cached_tokens, update, finished)
        finally:
            self.release(choices.request_ids, abort=choices.unfinished())

    def shutdown(self) -> None:
        """Stop the engine. Safe after the event loop has closed (the reader task dies with it)."""
        try:
            if self._reader is not None and not self._reader.get_loop().is_closed():
                self._reader.cancel()
        finally:
            self.client.shutdown()
