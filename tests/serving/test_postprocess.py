"""--num-postprocess-workers: Responses built in worker processes equal those built on the event loop."""

import asyncio
import re
import shutil

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from hybridserve.serving.parsers import Parsers
from hybridserve.serving.postprocess import PostprocessPool
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, call_until_disconnect
from tests.serving.openai.responses.test_responses import ASK, TEXT, events
from tests.serving.openai.responses.test_responses_store import paused_post, small_pages
from tests.serving.openai.test_forced_calls import LOOP, cut_in_third_call
from tests.serving.openai.test_tools import CALL, TOOLS, script
from tests.serving.openapi_schema import check

IDS = re.compile(r"(resp|msg|rs|fc|call)_[0-9a-f]{32}")


@pytest.fixture(scope="module")
def pool(smollm2_dir):
    pool = PostprocessPool(smollm2_dir, 2)
    yield pool
    pool.shutdown()


def normalized(value):
    """`value` with generated ids and timestamps replaced, so two runs compare equal."""
    if isinstance(value, dict):
        return {k: 0 if k in ("created_at", "completed_at") and v else normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return IDS.sub(lambda m: m.group(1) + "_x", value) if isinstance(value, str) else value


def both(tokenizer, pool, body: dict, scripts: list[list[int]], **engine_setup):
    """The same request answered without workers and with them: (response, engine) for each."""
    out = []
    for with_pool in (False, True):
        engine = FakeEngine(tokenizer, scripts, max_model_len=1024)
        for key, value in engine_setup.items():
            setattr(engine, key, value)
        app = build_app(engine, None, parsers=Parsers("think", "hermes"), postprocess=pool if with_pool else None)
        with TestClient(app) as client:
            r = client.post("/v1/responses", json=body)
            stored = client.get(f"/v1/responses/{r.json()['id']}") if not body.get("stream") else None
            out.append((r, engine, stored))
    return out


@pytest.mark.parametrize("max_output_tokens", [None, 3])
def test_non_streamed_responses_are_identical(tokenizer, pool, max_output_tokens):
    body = {"input": ASK, "max_output_tokens": max_output_tokens, "top_logprobs": 2}
    (local, _, _), (pooled, engine, stored) = both(tokenizer, pool, body, [PARIS])
    assert pooled.status_code == 200
    check(pooled.json(), "Response")
    assert normalized(pooled.json()) == normalized(local.json())
    assert stored.json() == pooled.json()  # storing stays on with workers
    assert engine.calls[0][0] == engine.calls[0][0] and engine.running == 0


@pytest.mark.parametrize("text", ["The capital of France is Paris.", "<think>Hmm.</think>Checking." + CALL])
def test_streamed_events_are_identical(tokenizer, pool, text):
    body = {"input": ASK, "stream": True, "tools": TOOLS}
    (local, _, _), (pooled, engine, _) = both(tokenizer, pool, body, [script(tokenizer, text)])
    assert normalized(events(pooled.text)) == normalized(events(local.text))
    assert events(pooled.text)[-1]["type"] == "response.completed"


def test_forced_calls_cut_short_are_streamed_as_without_workers(tokenizer, pool):
    body = {"input": ASK, "stream": True, "tools": TOOLS, "tool_choice": "required"}
    body["max_output_tokens"] = cut_in_third_call(tokenizer)
    (local, _, _), (pooled, _, _) = both(tokenizer, pool, body, [script(tokenizer, LOOP)])
    assert normalized(events(pooled.text)) == normalized(events(local.text))
    final = events(pooled.text)[-1]
    assert final["type"] == "response.incomplete"
    assert [item["type"] for item in final["response"]["output"]] == ["function_call"] * 2


def test_engine_failure_mid_stream(tokenizer, pool):
    body = {"input": ASK, "stream": True}
    (local, _, _), (pooled, engine, _) = both(tokenizer, pool, body, [PARIS], error_at_step=2)
    assert [e["type"] for e in events(pooled.text)][-2:] == ["error", "response.failed"]
    assert normalized(events(pooled.text)) == normalized(events(local.text))


def test_stop_string_aborts_the_engine_request(tokenizer, pool):
    # Responses has no stop field; a tiny max_output_tokens ends it early instead, and the engine is released.
    body = {"input": ASK, "max_output_tokens": 2}
    (local, _, _), (pooled, engine, _) = both(tokenizer, pool, body, [PARIS])
    assert normalized(pooled.json()) == normalized(local.json())
    assert pooled.json()["status"] == "incomplete" and engine.running == 0


def test_a_dead_worker_fails_its_responses_with_an_error_event(tokenizer, smollm2_dir):
    pool = PostprocessPool(smollm2_dir, 1)
    try:
        pool.processes[0].kill()
        pool.processes[0].join()
        engine = FakeEngine(tokenizer, [PARIS], max_model_len=1024)
        with TestClient(build_app(engine, None, postprocess=pool)) as client:
            evs = events(client.post("/v1/responses", json={"input": ASK, "stream": True}).text)
            assert [e["type"] for e in evs] == ["error", "response.failed"]
            assert evs[0]["message"] == "the post-processing worker for this response is not running"
            r = client.post("/v1/responses", json={"input": ASK})
            assert r.status_code == 500 and "post-processing worker" in r.json()["error"]["message"]
            assert engine.running == 0
    finally:
        pool.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_a_disk_that_fills_during_generation_answers_as_without_workers(tokenizer, pool, tmp_path, stream):
    answers = []
    for with_pool in (False, True):
        engine = FakeEngine(tokenizer, [PARIS], max_model_len=1024)
        engine.pause_at_step = 2
        shutil.rmtree(tmp_path / "data", ignore_errors=True)  # the same path each time: the same error message
        app = build_app(engine, None, small_pages(tmp_path / "data"), postprocess=pool if with_pool else None)
        with TestClient(app) as client:
            r, _ = paused_post(client, engine, app, {"input": ASK, "stream": stream})
            answers.append(normalized(events(r.text) if stream else r.json()))
    local, pooled = answers
    assert pooled == local
    final = pooled[-1]["response"] if stream else pooled
    assert final["status"] == "failed" and final["output"][0]["content"][0]["text"] == TEXT


def test_a_disconnect_stores_the_response_cancelled(tokenizer, pool):
    engine = FakeEngine(tokenizer, [PARIS], max_model_len=1024)
    engine.pause_at_step = 3
    app = build_app(engine, None, postprocess=pool)

    async def main():
        return await call_until_disconnect(app, "/v1/responses", {"input": ASK, "stream": True}, engine.paused)

    asyncio.run(main())
    [(_, _, rid)] = engine.calls
    stored = app.state.response_store.get(rid)
    assert (stored["status"], stored["output"]) == ("cancelled", [])  # the output so far was the worker's
    check(stored, "Response")
    assert engine.aborted == [rid]


def test_a_dead_worker_fails_only_its_own_responses(pool):
    """On the module's pool, so last in this file: it kills worker 0 for good (the fixture stops the rest)."""
    from hybridserve.serving.postprocess import _Ticket

    assert not pool._tickets  # every earlier response let its ticket go
    pool.processes[0].kill()
    pool.processes[0].join()
    orphan = _Ticket("resp_a", 0, pool._outboxes[0])
    alive = _Ticket("resp_b", 1, pool._outboxes[1])
    pool._tickets.update({orphan.request_id: orphan, alive.request_id: alive})
    pool._fail_orphans()
    pool._fail_orphans()  # once each
    [failed] = [orphan.results.get_nowait() for _ in range(orphan.results.qsize())]
    assert (failed.finish_reason, failed.error) == (
        "error",
        "post-processing worker hybridserve-postprocess-0 exited",
    )
    assert alive.results.empty() and list(pool._tickets) == ["resp_b"]
