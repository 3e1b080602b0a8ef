"""Background Responses: runs that outlive the request that started them, and their replayable events.

A background response is stored as `queued` before the POST answers, then runs in a task of its own (stored
`in_progress` as it starts), so a client that goes away loses nothing. Its events are kept in memory while it
runs (any number of followers read them live, from any `starting_after`) and written to the store with the
terminal object, in one transaction, so `GET /v1/responses/{id}?stream=true` replays them after it ends,
also after a restart. If that write fails, the response reads failed (see ResponseStore.finish) and its
events are not replayed.

Cancelling stops the engine work and stores the response as `cancelled`, with the output built so far.
The event stream then ends without a terminal event: the API has none for a cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator

from hybridserve.serving.openai.responses.events import ResponseRun
from hybridserve.serving.openai.responses.store import ResponseStore

logger = logging.getLogger(__name__)


class _Live:
    def __init__(self, response: ResponseRun) -> None:
        self.response = response
        self.frames: list[bytes] = []  # frame i has sequence_number i
        self.changed = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None


class BackgroundRuns:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._live: dict[str, _Live] = {}

    def start(self, response: ResponseRun) -> None:
        live = _Live(response)
        self._live[response.base["id"]] = live
        live.task = asyncio.create_task(self._run(live), name=f"background {response.base['id']}")

    async def _run(self, live: _Live) -> None:
        run = live.response
        response_id = run.base["id"]
        events = run.events(stream=True)
        try:
            self.store.start(response_id)
            async for frame in events:
                async with live.changed:
                    live.frames.append(frame)
                    live.changed.notify_all()
        except asyncio.CancelledError:  # cancel() or shutdown: the run stored itself as cancelled
            pass
        except sqlite3.Error as exc:  # its start could not be stored (a full disk): it does not run
            logger.error("background response %s could not start: %s", response_id, exc)
            run.fail(self.store.write_error(exc))
        except Exception:  # ResponseRun turns engine failures into events and stores a bug as failed
            logger.exception("background response %s failed", response_id)
        finally:
            await events.aclose()  # cancelled outside the run: closing it stores it as cancelled
            del self._live[response_id]
            async with live.changed:
                live.changed.notify_all()

    def sent(self, response_id: str) -> list[bytes]:
        """The events a running response has sent so far."""
        return list(self._live[response_id].frames)

    def is_live(self, response_id: str) -> bool:
        return response_id in self._live

    async def cancel(self, response_id: str) -> None:
        live = self._live.get(response_id)
        if live is not None and live.task is not None:
            live.task.cancel()
            await asyncio.wait([live.task])

    async def events(self, response_id: str, starting_after: int) -> AsyncIterator[bytes]:
        """Events after `starting_after`: live ones as they come, or the stored ones of a finished run."""
        live = self._live.get(response_id)
        if live is None:
            for frame in self.store.events(response_id)[starting_after + 1 :]:
                yield frame
            return
        sent = starting_after + 1
        while True:
            async with live.changed:
                while sent >= len(live.frames) and self.is_live(response_id):
                    await live.changed.wait()
                frames = live.frames[sent:]
            for frame in frames:
                yield frame
            sent += len(frames)
            if not frames and not self.is_live(response_id):
                return

    async def shutdown(self) -> None:
        """Cancels what still runs (the server is stopping): those responses are stored as cancelled."""
        tasks = [live.task for live in self._live.values() if live.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
