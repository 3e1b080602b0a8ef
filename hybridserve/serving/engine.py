"""What the serving layer needs of its engine: `hybridserve.engine.async_llm.AsyncLLM`, over any EngineClient
(in-process, a worker process, a router; the HTTP tests' scripted model)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats, WorkerStatus
from hybridserve.sampling_params import SamplingDefaults, SamplingParams


class ServingEngine(Protocol):
    model_name: str
    model_type: str | None  # the checkpoint's model_type: it chooses the serving extension
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    eos_token_ids: list[int]
    sampling_defaults: SamplingDefaults  # what requests that leave out temperature, top_p, ... sample with

    def stats(self) -> SchedulerStats: ...

    def workers(self) -> list[WorkerStatus]:
        """Each engine worker's state, stats and routing counts."""
        ...

    def start(self) -> None:
        """Begins the engine's background work (called once the event loop runs)."""
        ...

    async def check_health(self) -> None:
        """Raises saying why when the engine cannot serve."""
        ...

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Updates of every choice until all have finished; closing it early aborts what still runs.
        `priority`: lower is scheduled first (online traffic 0, batch work higher)."""
        ...

    async def add_requests(self, requests: list[EngineCoreRequest], route: Callable[[EngineCoreOutput], None]) -> None:
        """Runs engine requests whose raw outputs go to `route` until `release`."""
        ...

    def release(self, request_ids: list[str], abort: list[str]) -> None:
        """Stops routing these requests' outputs; the engine also stops its work on those in `abort`."""
        ...

    def shutdown(self) -> None: ...
