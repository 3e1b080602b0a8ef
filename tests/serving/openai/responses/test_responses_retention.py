"""Response store retention (count, age, unlimited) and `truncation` ("auto" / "disabled") of /v1/responses."""

import sqlite3

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving import cli
from hybridserve.serving.app import build_app
from hybridserve.serving.openai.responses.store import ResponseStore, Retention
from hybridserve.serving.parsers import Parsers
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, chat_prompt, error_body, serve_with_engine
from tests.serving.openapi_schema import check

TEXT = "The capital of France is Paris."


def not_found(rid: str, param: str | None = None) -> dict:
    return error_body(f"Response with id '{rid}' not found.", param=param, code="not_found")


def assert_gone(client, rid: str) -> None:
    """An evicted id answers exactly what a deleted or unknown one does, on every route."""
    for r in (
        client.get(f"/v1/responses/{rid}"),
        client.delete(f"/v1/responses/{rid}"),
        client.get(f"/v1/responses/{rid}/input_items"),
    ):
        assert (r.status_code, r.json()) == (404, not_found(rid))
    r = client.post("/v1/responses", json={"input": "more", "previous_response_id": rid})
    assert (r.status_code, r.json()) == (404, not_found(rid, "previous_response_id"))
    check(r.json(), "ErrorResponse")


def assert_kept(client, body: dict) -> None:
    assert client.get(f"/v1/responses/{body['id']}").json() == body


@pytest.fixture
def app_for(tokenizer):
    def make(retention: Retention):
        engine = FakeEngine(tokenizer, [PARIS])
        app = build_app(engine, None, retention=retention)
        return engine, app, TestClient(app)

    return make


def test_count_eviction_drops_the_oldest(app_for):
    engine, app, client = app_for(Retention(max_count=2))
    first, second, third = (client.post("/v1/responses", json={"input": t}).json() for t in ("One?", "Two?", "Three?"))
    assert first["created_at"] <= second["created_at"] <= third["created_at"]
    assert_gone(client, first["id"])
    assert_kept(client, second)
    assert_kept(client, third)
    assert app.state.response_store.count() == 2
    assert len(engine.calls) == 3  # the previous_response_id to the evicted one reached no engine


def test_count_eviction_orders_by_created_at_then_insertion():
    store = ResponseStore(":memory:", Retention(max_count=2, max_age_s=0))

    def put(rid: str, created_at: int) -> None:
        store.put({"id": rid, "created_at": created_at, "output": []}, [], [])

    def stored(*rids: str) -> list[str]:
        return [rid for rid in rids if store.get(rid) is not None]

    for rid in ("resp_b", "resp_a", "resp_c"):  # the same second: insertion order decides
        put(rid, 5)
    assert stored("resp_a", "resp_b", "resp_c") == ["resp_a", "resp_c"]
    put("resp_new", 9)
    put("resp_mid", 7)  # created_at decides: resp_a and resp_c (5) go, resp_new (inserted earlier) stays
    assert stored("resp_a", "resp_c", "resp_new", "resp_mid") == ["resp_new", "resp_mid"]


def test_age_eviction_uses_the_store_clock(app_for):
    _, app, client = app_for(Retention(max_count=0, max_age_s=100))
    store = app.state.response_store
    first = client.post("/v1/responses", json={"input": "One?"}).json()
    store.clock = lambda: first["created_at"] + 100  # exactly max_age old: kept
    second = client.post("/v1/responses", json={"input": "Two?"}).json()
    assert_kept(client, first)
    # created_at is wall-clock seconds: the second response may be a second younger than the first
    store.clock = lambda: second["created_at"] + 101
    third = client.post("/v1/responses", json={"input": "Three?", "previous_response_id": second["id"]}).json()
    assert third["status"] == "completed"
    # every response created at or before now - 100 is gone, except the one this put stored
    assert_gone(client, first["id"])
    assert_gone(client, second["id"])
    assert_kept(client, third)


def test_zero_means_unlimited(app_for):
    _, app, client = app_for(Retention(max_count=0, max_age_s=0))
    app.state.response_store.clock = lambda: 1 << 40
    bodies = [client.post("/v1/responses", json={"input": f"{i}?"}).json() for i in range(5)]
    for body in bodies:
        assert_kept(client, body)


def test_previous_response_id_to_an_evicted_response_is_a_404(app_for):
    engine, _, client = app_for(Retention(max_count=1))
    first = client.post("/v1/responses", json={"input": "One?"}).json()
    client.post("/v1/responses", json={"input": "Two?"})
    r = client.post("/v1/responses", json={"input": "Three?", "previous_response_id": first["id"]})
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": f"Response with id '{first['id']}' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "not_found",
        }
    }
    assert len(engine.calls) == 2


def test_retention_rejects_negative_limits():
    with pytest.raises(ValueError, match="max_count must be at least 0"):
        Retention(max_count=-1)
    with pytest.raises(ValueError, match="max_age_s must be at least 0"):
        Retention(max_age_s=-5)


def test_a_database_from_before_retention_gets_insertion_order(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE responses (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, response TEXT NOT NULL, "
        "prompt_messages TEXT NOT NULL);"
    )
    for rid in ("resp_1", "resp_2"):
        db.execute("INSERT INTO responses VALUES (?, 7, ?, '[]')", (rid, f'{{"id": "{rid}"}}'))
    db.commit()
    db.close()
    store = ResponseStore(path, Retention(max_count=2, max_age_s=0))
    store.put({"id": "resp_3", "created_at": 7, "output": []}, [], [])
    assert [store.get(rid) is not None for rid in ("resp_1", "resp_2", "resp_3")] == [False, True, True]


def test_cli_flags_reach_the_store(monkeypatch, tokenizer):
    seen = {}
    args = cli.build_parser().parse_args(["serve"])
    assert (args.response_store_max_count, args.response_store_max_age) == (10_000, 30 * 24 * 3600)

    def build_engine(config):
        return FakeEngine(tokenizer, [PARIS])

    def fake_build_app(engine, api_key, data_dir, retention, parsers, postprocess, extension, batch_settings, **_):
        seen["retention"], seen["parsers"] = retention, parsers
        raise SystemExit(0)

    serve_with_engine(monkeypatch, build_engine)
    monkeypatch.setattr("hybridserve.serving.app.build_app", fake_build_app)
    with pytest.raises(SystemExit):
        cli.main(
            [
                "serve",
                "--response-store-max-count",
                "0",
                "--response-store-max-age",
                "60",
                "--reasoning-parser",
                "think",
            ]
        )
    assert seen["retention"] == Retention(max_count=0, max_age_s=60)
    # SmolLM2's template knows no tools: they are written in the Hermes form and read back by that parser.
    assert seen["parsers"] == Parsers(reasoning="think", tool="hermes")


def test_cli_rejects_negative_retention(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--response-store-max-count", "-1"])
    assert exit_info.value.code == 2
    assert "--response-store-max-count: must be at least 0 (0 means unlimited), got -1" in capsys.readouterr().err


# --- truncation ---

INSTRUCTIONS = {"role": "system", "content": "Be brief."}
HISTORY = [
    {"role": "user", "content": "One?"},
    {"role": "assistant", "content": TEXT},
    {"role": "user", "content": "Two?"},
    {"role": "assistant", "content": TEXT},
    {"role": "user", "content": "Three?"},
]


def context_error(max_model_len: int, prompt_len: int, requested: int | None) -> dict:
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if requested is None:
        message = (
            f"{limit} However, your input resulted in {prompt_len} tokens, which leaves no room for the "
            "completion. Please reduce the length of the input."
        )
        return error_body(message, param="input", code="context_length_exceeded")
    message = (
        f"{limit} However, you requested {prompt_len + requested} tokens ({prompt_len} in the input, "
        f"{requested} in the completion). Please reduce the length of the input or completion."
    )
    param = "input" if prompt_len >= max_model_len else "max_output_tokens"
    return error_body(message, param=param, code="context_length_exceeded")


@pytest.mark.parametrize("max_output_tokens", [5, None])
def test_auto_drops_exactly_the_oldest_turns(tokenizer, max_output_tokens):
    full = chat_prompt(tokenizer, [INSTRUCTIONS, *HISTORY])
    drop_one = chat_prompt(tokenizer, [INSTRUCTIONS, *HISTORY[1:]])
    kept = chat_prompt(tokenizer, [INSTRUCTIONS, *HISTORY[2:]])
    assert len(full) > len(drop_one) > len(kept)
    room = max_output_tokens or 1
    engine = FakeEngine(tokenizer, [PARIS], max_model_len=len(kept) + room)
    client = TestClient(build_app(engine, None))
    request = {"input": HISTORY, "instructions": "Be brief.", "max_output_tokens": max_output_tokens}
    r = client.post("/v1/responses", json={**request, "truncation": "auto"})
    assert r.status_code == 200, r.json()
    body = r.json()
    assert body["truncation"] == "auto" and body["usage"]["input_tokens"] == len(kept)
    check(body, "Response")
    [(prompt, params, _)] = engine.calls
    assert prompt == kept and params.max_tokens == room
    # input_items still lists every input item the client sent
    items = client.get(f"/v1/responses/{body['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert [i["content"][0]["text"] for i in items] == [m["content"] for m in HISTORY]

    r = client.post("/v1/responses", json=request)  # truncation "disabled" by default
    assert (r.status_code, r.json()) == (400, context_error(engine.max_model_len, len(full), max_output_tokens))
    r = client.post("/v1/responses", json={**request, "truncation": "disabled"})
    assert (r.status_code, r.json()) == (400, context_error(engine.max_model_len, len(full), max_output_tokens))
    assert len(engine.calls) == 1


def test_auto_truncates_a_previous_response_id_chain(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS])
    client = TestClient(build_app(engine, None))
    first = client.post("/v1/responses", json={"input": "One?"}).json()
    second = client.post("/v1/responses", json={"input": "Two?", "previous_response_id": first["id"]}).json()
    kept = chat_prompt(tokenizer, HISTORY[2:])
    engine.max_model_len = len(kept) + 3
    request = {"input": "Three?", "previous_response_id": second["id"], "max_output_tokens": 3}
    body = client.post("/v1/responses", json={**request, "truncation": "auto"}).json()
    assert body["status"] == "incomplete" and engine.calls[-1][0] == kept  # cut at 3 output tokens
    assert client.post("/v1/responses", json=request).status_code == 400


@pytest.mark.parametrize("truncation", ["auto", "disabled"])
def test_an_oversized_newest_input_is_a_400_either_way(tokenizer, truncation):
    huge = {"role": "user", "content": "Paris " * 200}
    messages = [*HISTORY[:4], huge]
    full = chat_prompt(tokenizer, messages)
    engine = FakeEngine(tokenizer, [PARIS], max_model_len=len(chat_prompt(tokenizer, [huge])) - 1)
    client = TestClient(build_app(engine, None))
    r = client.post("/v1/responses", json={"input": messages, "max_output_tokens": 4, "truncation": truncation})
    assert (r.status_code, r.json()) == (400, context_error(engine.max_model_len, len(full), 4))
    assert engine.calls == []


def test_unknown_truncation_is_a_400(client):
    r = client.post("/v1/responses", json={"input": "x", "truncation": "sometimes"})
    assert (r.status_code, r.json()) == (
        400,
        error_body("truncation must be 'auto' or 'disabled'.", param="truncation", code="invalid_value"),
    )
