"""Clients' `priority` (vLLM's field) on every generation endpoint: refused under --scheduling-policy fcfs,
handed to the engine under `priority`, where the scheduler orders the queue by it, and never lifting online work
above batch work or batch work above online work (hybridserve/serving/openai/priority.py)."""

import pytest
from fastapi.testclient import TestClient

from hybridserve.config import SchedulerConfig
from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler
from hybridserve.serving.app import build_app, default_parsers
from hybridserve.serving.extensions import extension_for
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.batches.execute import call_endpoint
from hybridserve.serving.openai.batches.protocol import InputLine
from hybridserve.serving.openai.endpoints import GenerationServices
from hybridserve.serving.openai.priority import BATCH_OFFSET, PRIORITY_LIMIT
from hybridserve.serving.openai.responses.store import ResponseStore
from hybridserve.serving.storage import Database
from tests.serving.anthropic.helpers import error
from tests.serving.helpers import QUESTION, assert_error

BODIES = {
    "/v1/chat/completions": {"messages": QUESTION, "max_tokens": 2},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 2},
    "/v1/responses": {"input": "What is the capital of France?", "max_output_tokens": 16},
    "/v1/messages": {"model": "smollm2", "messages": QUESTION, "max_tokens": 2},
}
FCFS_REFUSAL = (
    "priority {} is only honoured by a server started with --scheduling-policy priority; this one schedules first "
    "come, first served (--scheduling-policy fcfs). Leave priority unset or 0."
)


@pytest.fixture
def priority_client(engine):
    with TestClient(build_app(engine, None, scheduling_policy="priority")) as client:
        yield client


def assert_refused(r, path: str, message: str) -> None:
    if path == "/v1/messages":  # Anthropic's shape, the same message
        assert (r.status_code, r.json()) == (400, error("invalid_request_error", message))
    else:
        assert_error(r, 400, message, param="priority", code="invalid_value")


@pytest.mark.parametrize("path", BODIES)
def test_fcfs_refuses_a_priority_naming_the_flag(client, engine, path):
    r = client.post(path, json={**BODIES[path], "priority": -5})
    assert_refused(r, path, FCFS_REFUSAL.format(-5))
    assert engine.calls == []
    assert client.post(path, json={**BODIES[path], "priority": 0}).status_code == 200  # 0 is fcfs' own
    assert list(engine.priorities.values()) == [0]


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("value", [PRIORITY_LIMIT + 1, -PRIORITY_LIMIT - 1])
def test_a_priority_out_of_range_is_a_400_naming_field_and_value(priority_client, engine, path, value):
    r = priority_client.post(path, json={**BODIES[path], "priority": value})
    assert_refused(r, path, f"priority must be in [-1000000, 1000000], got {value}.")
    assert engine.calls == []


def test_a_priority_must_be_an_integer(priority_client):
    r = priority_client.post("/v1/chat/completions", json={**BODIES["/v1/chat/completions"], "priority": 1.5})
    message = "Invalid value for 'priority': Input should be a valid integer, got 1.5."
    assert_error(r, 400, message, param="priority", code="invalid_type")


@pytest.mark.parametrize("path", BODIES)
def test_the_engine_gets_each_endpoints_priority(priority_client, engine, path):
    for value in (PRIORITY_LIMIT, -PRIORITY_LIMIT, 7, None):
        body = BODIES[path] if value is None else {**BODIES[path], "priority": value}
        assert priority_client.post(path, json=body).status_code == 200
    assert [r.priority for r in engine.requests] == [PRIORITY_LIMIT, -PRIORITY_LIMIT, 7, 0]


def test_the_queue_follows_priority_and_batch_work_stays_behind_every_online_request(priority_client, engine):
    """Engine requests as the server made them, queued in arrival order in the engine's own scheduler (one
    sequence at a time: a loaded server): online work by its priority, then the batch line, though it came
    first and asked for the most urgent priority a client may."""
    services = GenerationServices.build(
        engine,
        ServingMetrics(engine.model_name, engine.workers),
        ResponseStore(Database(":memory:")),
        default_parsers(engine.tokenizer, extension_for(None)),
        extension_for(None),
        policy="priority",
    )
    url = "/v1/chat/completions"
    line = InputLine(custom_id="nightly", method="POST", url=url, body={**BODIES[url], "priority": -PRIORITY_LIMIT})
    endpoint = services.batch_endpoints()[url]
    status, _ = priority_client.portal.call(call_endpoint, endpoint, line, "test batch")
    assert status == 200
    for value in (5, PRIORITY_LIMIT, -3, 0):
        assert priority_client.post(url, json={**BODIES[url], "priority": value}).status_code == 200
    assert [r.priority for r in engine.requests] == [BATCH_OFFSET - PRIORITY_LIMIT, 5, PRIORITY_LIMIT, -3, 0]
    assert min(r.priority for r in engine.requests[:1]) > max(r.priority for r in engine.requests[1:])

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1), KVCacheManager(64, 16, True), "cpu")
    for request in engine.requests:
        scheduler.add(Request(request, engine.max_model_len))
    queued = [r.priority for r in scheduler.waiting]
    assert queued == [-3, 0, 5, PRIORITY_LIMIT, BATCH_OFFSET - PRIORITY_LIMIT]
    [first] = scheduler.schedule().scheduled
    assert scheduler.requests[first.request_id].priority == -3
