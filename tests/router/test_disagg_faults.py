"""Faults of disaggregation, each caused for real on loopback workers (kimi-linear-tiny: KV blocks and recurrent
state): a prefill worker killed or stopped while its prefilled request waits to be read, a decode worker killed
while the prefill worker holds a request for it, and a peer whose cache layout differs. Only the request that
was in transfer is affected (it fails with a clear error, or is recomputed on the decode worker), the other
requests go on, and every cache's integrity check passes on both sides afterwards.

To make the timing deterministic, the decode worker takes one sequence at a time: a long request occupies it,
so the victim waits (prefilled and held on the prefill worker) until the test has caused the fault. The tests
share one deployment per failure policy; each leaves both workers up and nothing held.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from hybridserve.config import DeploymentConfig, EngineConfig
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.core import EngineCore
from hybridserve.engine.kv_transfer.messages import RemoteDecode, RemotePrefill
from hybridserve.engine.protocol import EngineCoreRequest, FinishReason
from hybridserve.router.deploy import build_engine
from hybridserve.router.link import WorkerLink, WorkerState
from hybridserve.sampling_params import SamplingParams

TIMEOUT_S = 60.0
ENGINE = {
    "dtype": "float32",
    "kv_cache_memory_bytes": 32 * 1024**2,
    "num_threads": 1,
    "max_num_seqs": 1,
    "kv_transfer_timeout": 2.0,
    "kv_lease": 3.0,
}
# The stopped-worker test needs the transfer deadline (2 s from the start of the read) to fire before the
# transport heartbeat (worker_timeout from the SIGSTOP): the decode worker first has to let the blocker go and
# start the read, which took over 3 s once on a loaded two-core machine. A killed worker's connection closes
# at once, so the kill tests do not wait for the heartbeat.
DEPLOYMENT = DeploymentConfig(
    num_prefill_workers=1, num_decode_workers=1, max_local_prefill_tokens=0, worker_timeout=10.0
)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BLOCKER = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)


async def _until(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _collect(engine: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str) -> tuple[list[int], str]:
    ids: list[int] = []
    async for update in engine.generate(prompt, params, rid):
        ids += update.output.delta_token_ids
        if update.finished:
            return ids, update.output.error or str(update.output.finish_reason)
    raise AssertionError("the stream ended without a finish")


def _link(engine: AsyncLLM, role: str) -> WorkerLink:
    return next(w for w in engine.client.links if w.role == role)


def _signal(engine: AsyncLLM, role: str, sig: signal.Signals) -> WorkerLink:
    """Sends `sig` to the local worker of this role; its link."""
    link = _link(engine, role)
    assert link.process is not None and link.process.pid
    os.kill(link.process.pid, sig)
    return link


async def _stat(engine: AsyncLLM, role: str, field: str) -> int:
    reports = await engine.client.check_integrity()
    report = reports.get(_link(engine, role).name)
    return -1 if report is None else getattr(report.stats, field)  # -1: it is not up


async def _integrity(engine: AsyncLLM) -> None:
    reports = await engine.client.check_integrity()
    assert {r.error for r in reports.values()} == {None}, {n: r.error for n, r in reports.items()}
    assert len(reports) == 2, f"both workers are up and checked: {sorted(reports)}"


async def _victim_waits(engine: AsyncLLM, prompt: list[int]) -> tuple[asyncio.Task, asyncio.Task]:
    """A blocker decoding on the decode worker, and a victim held on the prefill worker behind it."""
    await engine.client.check_health()  # opens the sessions
    await _until("both workers up", _coro(lambda: all(w.state is WorkerState.UP for w in engine.client.links)))
    blocker = asyncio.create_task(_collect(engine, prompt[:5], BLOCKER, "blocker"))
    await _until("the blocker to run", lambda: _running(engine))
    victim = asyncio.create_task(_collect(engine, prompt, GREEDY, "victim"))
    # Queued on the decode worker, so prefilled and held (the blocker's `done` may reach the prefill worker
    # after the victim, which then waits there for the one state slot: its kv_held alone could be the blocker).
    await _until("the victim to be handed off", lambda: _waiting_on_decode(engine))
    assert await _held(engine, 1)
    return blocker, victim


async def _waiting_on_decode(engine: AsyncLLM) -> bool:
    return await _stat(engine, "decode", "num_waiting") == 1


async def _running(engine: AsyncLLM) -> bool:
    return await _stat(engine, "decode", "num_running") == 1


async def _held(engine: AsyncLLM, n: int) -> bool:
    return await _stat(engine, "prefill", "kv_held") == n


Scenario = Callable[[AsyncLLM], Awaitable[None]]


@pytest.fixture(scope="module")
def run_on(kimi_linear_dir: Path) -> Iterator[Callable[[str, Scenario], None]]:
    """Runs a scenario on the deployment of a failure policy, started on first use and kept for the module (one
    event loop for all, since the router's tasks live on it)."""
    loop = asyncio.new_event_loop()
    engines: dict[str, AsyncLLM] = {}

    def run(policy: str, scenario: Scenario) -> None:
        if policy not in engines:
            config = EngineConfig.of(
                model=str(kimi_linear_dir), **ENGINE, kv_transfer_failure=policy, kv_cache_prefault=False
            )
            engines[policy] = build_engine(config, DEPLOYMENT)
        loop.run_until_complete(asyncio.wait_for(scenario(engines[policy]), 4 * TIMEOUT_S))

    yield run
    for engine in engines.values():
        engine.shutdown()
    pending = asyncio.all_tasks(loop)  # the routers' readers, cancelled by shutdown but not yet run to their end
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def _prompt(engine: AsyncLLM) -> list[int]:
    return engine.tokenizer.encode("A prompt long enough to fill a few KV blocks of sixteen tokens each. " * 3)


async def _unblock(blocker: asyncio.Task, engine: AsyncLLM) -> None:
    engine.client.abort(["blocker"])
    ids, end = await blocker
    assert end == "abort" and ids  # it ran, then went when asked


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_worker_killed_before_the_read(run_on: Callable[[str, Scenario], None], policy: str) -> None:
    async def scenario(engine: AsyncLLM) -> None:
        prompt = _prompt(engine)
        reference = await _collect(engine, prompt, GREEDY, "reference")
        blocker, victim = await _victim_waits(engine, prompt)
        prefill = _signal(engine, "prefill", signal.SIGKILL)
        await _until("the prefill worker to be marked down", _coro(lambda: prefill.state is not WorkerState.UP))
        await _unblock(blocker, engine)
        ids, end = await victim
        if policy == "fail":
            assert ids == reference[0][:1]  # the first token came from the prefill worker, then the error
            assert end.startswith(f"KV transfer from prefill worker {prefill.transfer.agent} failed: reading from")
        else:
            assert (ids, end) == reference  # prefilled again on the decode worker: the same tokens
        assert await _stat(engine, "decode", "kv_pulls_failed") == 1
        await _until("the prefill worker to be back", _coro(lambda: prefill.state is WorkerState.UP))
        assert await _collect(engine, prompt, GREEDY, "after") == reference  # served disaggregated again
        await _integrity(engine)

    run_on(policy, scenario)


def test_stopped_prefill_worker_is_bounded_by_the_deadline(run_on: Callable[[str, Scenario], None]) -> None:
    async def scenario(engine: AsyncLLM) -> None:
        prompt = _prompt(engine)
        blocker, victim = await _victim_waits(engine, prompt)
        prefill = _signal(engine, "prefill", signal.SIGSTOP)
        assert prefill.process is not None and prefill.process.pid
        try:
            started = time.monotonic()
            await _unblock(blocker, engine)
            ids, end = await victim
            assert end.endswith("no data from it within 2s (deadline)"), end
            assert time.monotonic() - started < 2 + 10  # the deadline, not the worker timeout nor forever
        finally:
            os.kill(prefill.process.pid, signal.SIGCONT)
        # It hears `drop` once it runs again and frees the victim (or its lease runs out).
        await _until("the prefill worker to free the victim", lambda: _held_or_down(engine))
        await _until("both workers up", _coro(lambda: all(w.state is WorkerState.UP for w in engine.client.links)))
        await _integrity(engine)
        assert await _stat(engine, "prefill", "kv_held") == 0

    run_on("fail", scenario)


async def _held_or_down(engine: AsyncLLM) -> bool:
    if _link(engine, "prefill").state is not WorkerState.UP:
        return False
    return await _held(engine, 0)


def test_dead_decode_worker_strands_nothing_on_the_prefill_worker(run_on: Callable[[str, Scenario], None]) -> None:
    async def scenario(engine: AsyncLLM) -> None:
        prompt = _prompt(engine)
        blocker, victim = await _victim_waits(engine, prompt)
        decode = _signal(engine, "decode", signal.SIGKILL)
        for task, rid in ((blocker, "blocker"), (victim, "victim")):
            ids, end = await task
            assert "went down" in end, (rid, end)  # failed as unavailable, with the worker named
        killed = time.monotonic()
        await _until("the prefill worker to let the victim go", lambda: _held(engine, 0))
        # The frontend told it at once (an abort of the held copy), so the lease (3 s) did not have to run out.
        assert time.monotonic() - killed < 3
        assert await _stat(engine, "prefill", "kv_leases_expired") == 0
        await _until("the decode worker to be back", _coro(lambda: decode.state is WorkerState.UP))
        await _integrity(engine)

    run_on("fail", scenario)


def _coro(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        return check()

    return run


def test_incompatible_peer_fails_only_its_requests(kimi_linear_dir: Path) -> None:
    """A prefill worker whose KV blocks are twice as long: the decode worker refuses it at first contact,
    naming the difference, remembers that, and fails only the requests that would read from it."""
    base = {"model": str(kimi_linear_dir), "kv_cache_memory_bytes": 16 * 1024**2, "num_threads": 1}
    good = EngineCore(
        EngineConfig.of(**base, dtype="float32", role="prefill", kv_cache_prefault=False), kimi_linear_dir
    )
    bad = EngineCore(
        EngineConfig.of(**base, dtype="float32", block_size=32, role="prefill", kv_cache_prefault=False),
        kimi_linear_dir,
    )
    decode = EngineCore(
        EngineConfig.of(**base, dtype="float32", role="decode", kv_cache_prefault=False), kimi_linear_dir
    )
    assert good.connector and bad.connector and decode.connector
    decode.add_transfer_peer(good.connector.endpoint)
    decode.add_transfer_peer(bad.connector.endpoint)
    prompt = list(range(10, 60))
    sources = {}
    for name, core in (("good", good), ("bad", bad)):
        core.add_request(EngineCoreRequest(name, prompt, GREEDY, [], 0.0, kv_transfer=RemoteDecode()))
        while name not in sources:
            for out in core.step().outputs:
                assert out.kv_transfer is not None
                sources[name] = RemotePrefill(out.kv_transfer, out.new_token_ids[0])
    for attempt in ("bad", "bad-again", "good"):
        source = sources[attempt.split("-")[0]]
        decode.add_request(EngineCoreRequest(attempt, prompt, GREEDY, [], 0.0, kv_transfer=source))
    ends: dict[str, tuple[FinishReason | None, str | None]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(ends) < 3 and time.monotonic() < deadline:
        for out in decode.step().outputs:
            if out.finish_reason is not None:
                ends[out.request_id] = (out.finish_reason, out.error)
        good.step()
    problem = (
        f"prefill worker {bad.connector.endpoint.agent} is incompatible with this decode worker: block_size 32 != 16"
    )
    assert ends["bad"] == ends["bad-again"] == (FinishReason.ERROR, problem)
    assert ends["good"] == (FinishReason.LENGTH, None)
    assert decode.connector.counters.pulls_done == 1
    for core in (good, bad, decode):
        core.check_integrity()


def test_a_held_request_aborted_by_its_frontend_is_let_go_at_once(kimi_linear_dir: Path) -> None:
    """The client left while its prefill finished (or no decode worker was up): the frontend aborts the held copy
    on the prefill worker, which frees it without waiting for the lease and tells nobody."""
    config = EngineConfig.of(
        model=str(kimi_linear_dir),
        kv_cache_memory_bytes=16 * 1024**2,
        num_threads=1,
        role="prefill",
        kv_cache_prefault=False,
    )
    core = EngineCore(config, kimi_linear_dir)
    assert core.connector is not None
    free = core.kv.pool.num_free
    core.add_request(EngineCoreRequest("gone", list(range(10, 60)), GREEDY, [], 0.0, kv_transfer=RemoteDecode()))
    deadline = time.monotonic() + TIMEOUT_S
    assert core.scheduler.connector is not None
    while not core.scheduler.connector.held and time.monotonic() < deadline:
        core.step()
    assert list(core.scheduler.connector.held) == ["gone"] and len(core.scheduler.connector.leases) == 1
    core.abort(["gone"])
    assert core.step().outputs == []
    assert not core.scheduler.connector.held and len(core.scheduler.connector.leases) == 0
    assert core.kv.pool.num_free == free  # every block back (the prompt's stay cached, evictable)
    core.check_integrity()


def test_a_request_behind_a_held_one_waits_for_its_state_slot(kimi_linear_dir: Path) -> None:
    """A prefill worker with one state slot holds a prefilled request until its decode worker reads it; the next
    request waits for that slot (it used to fail at once, told the cache was too small for it), then prefills."""
    base = {"model": str(kimi_linear_dir), "kv_cache_memory_bytes": 16 * 1024**2, "num_threads": 1}
    prefill = EngineCore(
        EngineConfig.of(**base, dtype="float32", max_num_seqs=1, role="prefill", kv_cache_prefault=False),
        kimi_linear_dir,
    )
    decode = EngineCore(
        EngineConfig.of(**base, dtype="float32", role="decode", kv_cache_prefault=False), kimi_linear_dir
    )
    assert prefill.connector and decode.connector
    decode.add_transfer_peer(prefill.connector.endpoint)
    prompt = list(range(10, 60))
    sources: dict[str, RemotePrefill] = {}
    ends: dict[str, tuple[FinishReason | None, str | None]] = {}

    def step(core: EngineCore) -> None:
        for out in core.step().outputs:
            if out.kv_transfer is not None:
                sources[out.request_id] = RemotePrefill(out.kv_transfer, out.new_token_ids[0])
            if out.finish_reason is not None:
                ends[out.request_id] = (out.finish_reason, out.error)

    prefill.add_request(EngineCoreRequest("first", prompt, GREEDY, [], 0.0, kv_transfer=RemoteDecode()))
    deadline = time.monotonic() + TIMEOUT_S
    while "first" not in sources and time.monotonic() < deadline:
        step(prefill)
    prefill.add_request(EngineCoreRequest("second", prompt[::-1], GREEDY, [], 0.0, kv_transfer=RemoteDecode()))
    for _ in range(5):
        step(prefill)
    assert (ends, sorted(prefill.held_for_readers), prefill.stats().num_waiting) == ({}, ["first"], 1)
    decode.add_request(EngineCoreRequest("first", prompt, GREEDY, [], 0.0, kv_transfer=sources["first"]))
    while "second" not in sources and time.monotonic() < deadline:
        step(decode)
        step(prefill)  # hears `done` for the first, which frees the slot
    assert sorted(prefill.held_for_readers) == ["second"] and prefill.stats().kv_leases_expired == 0
    while "first" not in ends and time.monotonic() < deadline:
        step(decode)
    assert ends == {"first": (FinishReason.LENGTH, None)}
    for core in (prefill, decode):
        core.check_integrity()
