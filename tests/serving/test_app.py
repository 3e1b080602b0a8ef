"""Models, health, version and metrics endpoints."""

import time

from tests.serving.helpers import QUESTION, error_body
from tests.serving.openapi_schema import check


def test_models(client):
    body = client.get("/v1/models").json()
    check(body, "ListModelsResponse")
    card = body["data"][0]
    assert abs(card["created"] - time.time()) < 60
    assert body == {
        "object": "list",
        "data": [
            {
                "id": "smollm2",
                "object": "model",
                "created": card["created"],
                "owned_by": "hybridserve",
                "max_model_len": 256,
            }
        ],
    }
    assert client.get("/v1/models/smollm2").json() == card


def test_health_and_version(client, engine):
    workers = [{"name": "fake", "role": "both", "state": "up", "error": None}]
    assert (client.get("/health").status_code, client.get("/health").json()) == (
        200,
        {"status": "ok", "workers": workers},
    )
    assert set(client.get("/version").json()) == {"version"}
    engine.dead = True
    r = client.get("/health")
    assert (r.status_code, r.json()) == (
        503,
        error_body(
            "The engine is not healthy: engine process exited with code 1",
            "server_error",
            code="engine_unhealthy",
        ),
    )


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_after_a_request(client):
    client.post("/v1/chat/completions", json={"messages": QUESTION})
    client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2, "stream": True})
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    label = '{model_name="smollm2"}'
    assert sample(text, 'hybridserve:request_outcome_total{model_name="smollm2",outcome="stop"}') == 1
    assert sample(text, 'hybridserve:request_outcome_total{model_name="smollm2",outcome="length"}') == 1
    assert sample(text, 'hybridserve:request_outcome_total{model_name="smollm2",outcome="abort"}') == 0
    assert sample(text, 'hybridserve:request_outcome_total{model_name="smollm2",outcome="error"}') == 0
    assert sample(text, "hybridserve:prompt_tokens_total" + label) == 2 * 37
    assert sample(text, "hybridserve:generation_tokens_total" + label) == 8 + 2
    assert sample(text, "hybridserve:time_to_first_token_seconds_count" + label) == 2
    assert sample(text, "hybridserve:inter_token_latency_seconds_count" + label) == 7 + 1
    assert sample(text, "hybridserve:e2e_request_latency_seconds_count" + label) == 2
    worker = '{model_name="smollm2",worker="fake"}'
    assert sample(text, "hybridserve:num_requests_running" + worker) == 0
    assert sample(text, "hybridserve:num_requests_waiting" + worker) == 0
    assert sample(text, "hybridserve:kv_cache_usage_perc" + worker) == 0
    assert sample(text, "hybridserve:prefix_cache_queries_total" + worker) == 100
    assert sample(text, "hybridserve:prefix_cache_hits_total" + worker) == 25
    assert sample(text, "hybridserve:prefix_cache_hit_rate" + worker) == 0.25
    assert sample(text, "hybridserve:num_preemptions_total" + worker) == 0
    assert sample(text, "hybridserve:num_state_snapshots" + worker) == 3
    assert sample(text, "hybridserve:state_snapshot_usage_perc" + worker) == 0.75
    assert sample(text, "hybridserve:state_snapshot_hits_total" + worker) == 2
    assert sample(text, 'hybridserve:worker_up{model_name="smollm2",worker="fake"}') == 1
    labels = 'model_name="smollm2",outcome="miss",policy="round_robin",worker="fake"'
    decision = "hybridserve:router_decisions_total{" + labels + "}"
    assert sample(text, decision) == 0


def test_metrics_count_errors(client, engine):
    engine.error_at_step = 1
    client.post("/v1/chat/completions", json={"messages": QUESTION, "n": 2})
    text = client.get("/metrics").text
    assert sample(text, 'hybridserve:request_outcome_total{model_name="smollm2",outcome="error"}') == 2


def test_apps_do_not_share_metrics(client, engine):
    from hybridserve.serving.app import build_app

    client.post("/v1/chat/completions", json={"messages": QUESTION})
    other = build_app(engine, None).state.metrics.registry
    assert other.get_sample_value("hybridserve:prompt_tokens_total", {"model_name": "smollm2"}) == 0
