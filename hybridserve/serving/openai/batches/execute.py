"""Running batch lines, shared by the online runner and `hybridserve run-batch`.

`call_endpoint` hands a line's body to its endpoint's service (`BatchEndpoint.create`, the code behind the HTTP
route) and returns the status and body bytes the route would have answered, errors included, so a batch's
response bodies are the HTTP API's own. `run_bounded` runs such requests at most `limit` at a time, and
`Progress` counts what finished and says so in one log line. `engine_stopped` tells a request's own failure
from the engine's: a request the engine could not serve because it stopped is never written as a result, so a
resumed run retries it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import msgspec
from pydantic import ValidationError
from starlette.requests import Request

from hybridserve.serving.openai.batches.protocol import BatchEndpoint, InputLine
from hybridserve.serving.openai.errors import SERVER_ERROR, APIError, validation_error
from hybridserve.serving.openai.priority import batch_state

logger = logging.getLogger(__name__)


async def call_endpoint(endpoint: BatchEndpoint, line: InputLine, who: str) -> tuple[int, bytes]:
    """`(status, body)` of the line's request as its HTTP route answers it; `who` names the batch in logs."""
    try:
        req = endpoint.model.model_validate(line.body)
        response = await endpoint.create(req, detached_request(line.url))
        return response.status_code, bytes(response.body)
    except APIError as exc:
        return exc.status, msgspec.json.encode(exc.body())
    except ValidationError as exc:
        error = validation_error(list(exc.errors()))
        return error.status, msgspec.json.encode(error.body())
    except Exception as exc:  # what the HTTP route would answer 500 for
        logger.exception("%s: request %r failed", who, line.custom_id)
        error = APIError(500, f"Internal server error: {exc}", type=SERVER_ERROR)
        return error.status, msgspec.json.encode(error.body())


async def engine_stopped(status: int, health: Callable[[], Awaitable[None]]) -> str | None:
    """Why the engine, not the request, failed a request answered `status`: a 503 (the worker serving it
    went down) or another 5xx while `health` (the engine's check_health) raises. None for the request's own
    answer, a 5xx from a healthy engine included."""
    if status < 500:
        return None
    try:
        await health()
    except Exception as exc:
        return str(exc)
    return "the engine worker serving the request went down" if status == 503 else None


async def _never() -> dict:
    return await asyncio.get_running_loop().create_future()


def detached_request(path: str) -> Request:
    """The `request` a service watches for a disconnect: a batch request has no client to lose. Its scope
    says it is batch work, which the scheduler admits after every online request and preempts first."""
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    return Request({**scope, "state": batch_state()}, _never)


async def run_bounded(requests: Iterable[Awaitable[None]], limit: int) -> None:
    """Awaits every request, at most `limit` at a time, taking the next from `requests` (read lazily) as one
    finishes. The first that raises cancels the others and raises; so does a cancellation of this call."""
    in_flight: set[asyncio.Task[None]] = set()
    try:
        for request in requests:
            in_flight.add(asyncio.ensure_future(request))
            while len(in_flight) >= limit:
                finished, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                _raise_failures(finished)
        if in_flight:
            finished, in_flight = await asyncio.wait(in_flight)
            _raise_failures(finished)
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            finished, _ = await asyncio.wait(in_flight)
            _failures(finished)  # retrieved: what one raised while being cancelled is not worth a warning


def _raise_failures(finished: set[asyncio.Task[None]]) -> None:
    if failures := _failures(finished):
        raise failures[0]


def _failures(finished: set[asyncio.Task[None]]) -> list[BaseException]:
    """What the tasks raised (each exception retrieved, so asyncio does not log it as never retrieved)."""
    return [exc for task in finished if not task.cancelled() and (exc := task.exception()) is not None]


@dataclass
class Progress:
    """Requests done of a batch, with those a resumed batch had done before this run: the rate counts only
    this run's."""

    completed: int = 0
    failed: int = 0
    started: float = field(default_factory=time.monotonic)
    done_at_start: int = field(init=False)

    def __post_init__(self) -> None:
        self.done_at_start = self.done

    @property
    def done(self) -> int:
        return self.completed + self.failed

    def count(self, ok: bool) -> None:
        if ok:
            self.completed += 1
        else:
            self.failed += 1

    def line(self, total: int) -> str:
        elapsed = time.monotonic() - self.started
        rate = (self.done - self.done_at_start) / elapsed if elapsed > 0 else 0.0
        eta = f"{(total - self.done) / rate:.0f} s" if rate > 0 else "unknown"
        return (
            f"{self.done}/{total} requests done ({self.completed} completed, {self.failed} failed), {rate:.2f}/s, "
            f"ETA {eta}"
        )
