"""POST/GET/DELETE /v1/responses against the fake engine: exact objects, exact event sequences, the store."""

import asyncio
import json
import re

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, QUESTION, assert_error, call_until_disconnect, chat_prompt
from tests.serving.openapi_schema import check

TEXT = "The capital of France is Paris."
ASK = "What is the capital of France?"
USAGE_37_8 = {
    "input_tokens": 37,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens": 8,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 45,
}
MESSAGE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
DONE_EVENTS = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def expected_response(body: dict, **fields) -> dict:
    """The whole object this server answers for ASK with no options, with `fields` replaced."""
    out = {
        "id": body["id"],
        "object": "response",
        "created_at": body["created_at"],
        "status": "completed",
        "completed_at": body["completed_at"],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": "smollm2",
        "output": [
            {
                "id": body["output"][0]["id"] if body["output"] else None,
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": TEXT, "annotations": [], "logprobs": []}],
            }
        ],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": None,
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "top_logprobs": 0,
        "truncation": "disabled",
        "usage": USAGE_37_8,
        "metadata": {},
        "prompt_cache_key": None,
        "background": False,
    }
    out.update(fields)
    return out


def events(text: str) -> list[dict]:
    """Parses `event: <type>\\ndata: <json>` frames, checking that each frame's event name is its type."""
    assert text.endswith("\n\n") and "[DONE]" not in text
    out = []
    for frame in text.split("\n\n")[:-1]:
        head, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        check(payload, "ResponseStreamEvent")
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_create_answers_the_whole_object(client, engine, tokenizer):
    r = client.post("/v1/responses", json={"model": "smollm2", "input": ASK})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert re.fullmatch(r"resp_[0-9a-f]{32}", body["id"])
    assert re.fullmatch(r"msg_[0-9a-f]{32}", body["output"][0]["id"])
    assert body == expected_response(body)
    assert body["completed_at"] >= body["created_at"]
    check(body, "Response")
    [(prompt, params, request_id)] = engine.calls
    assert prompt == chat_prompt(tokenizer, QUESTION) and request_id == body["id"]
    assert params.max_tokens == engine.max_model_len - 37 and params.temperature == 1.0


def test_fields_are_echoed_and_mapped(client, engine, tokenizer):
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": True}]
    request = {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
        "instructions": "Be brief.",
        "max_output_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"k": "v"},
        "user": "u1",
        "tools": tools,
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "text"}},
        "include": ["reasoning.encrypted_content"],
        "truncation": "auto",
        "prompt_cache_key": "pck",
        "background": False,
    }
    body = client.post("/v1/responses", json=request).json()
    assert body == expected_response(
        body,
        instructions="Be brief.",
        max_output_tokens=20,
        temperature=0.5,
        top_p=0.9,
        metadata={"k": "v"},
        user="u1",
        tools=[{**tools[0], "description": None}],
        tool_choice="none",
        parallel_tool_calls=False,
        reasoning={"effort": "low"},
        truncation="auto",
        prompt_cache_key="pck",
        usage={**USAGE_37_8, "input_tokens": 24, "total_tokens": 32},
    )
    check(body, "Response")
    [(prompt, params, _)] = engine.calls
    assert prompt == chat_prompt(tokenizer, [{"role": "system", "content": "Be brief."}, *QUESTION])
    assert (params.max_tokens, params.temperature, params.top_p) == (20, 0.5, 0.9)


def test_incomplete_when_cut_by_max_output_tokens(client):
    body = client.post("/v1/responses", json={"input": ASK, "max_output_tokens": 3}).json()
    cut = {**expected_response(body)["output"][0], "status": "incomplete"}
    cut["content"] = [{"type": "output_text", "text": "The capital of", "annotations": [], "logprobs": []}]
    assert body == expected_response(
        body,
        status="incomplete",
        completed_at=None,
        incomplete_details={"reason": "max_output_tokens"},
        max_output_tokens=3,
        output=[cut],
        usage={**USAGE_37_8, "output_tokens": 3, "total_tokens": 40},
    )
    check(body, "Response")


@pytest.mark.parametrize("max_output_tokens", [None, 3])
def test_stream_event_sequence(client, max_output_tokens):
    r = client.post("/v1/responses", json={"input": ASK, "stream": True, "max_output_tokens": max_output_tokens})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    pieces = (
        ["The", " capital", " of"] if max_output_tokens else ["The", " capital", " of", " France", " is", " Paris", "."]
    )
    terminal = "response.incomplete" if max_output_tokens else "response.completed"
    assert [e["type"] for e in evs] == MESSAGE_EVENTS + ["response.output_text.delta"] * len(pieces) + DONE_EVENTS + [
        terminal
    ]
    final = evs[-1]["response"]
    item_id = final["output"][0]["id"]
    in_progress = {**final, "status": "in_progress", "completed_at": None, "incomplete_details": None, "output": []}
    del in_progress["usage"]
    assert evs[0]["response"] == evs[1]["response"] == in_progress
    assert evs[2]["item"] == {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [],
    }
    assert evs[2]["output_index"] == 0
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    assert evs[3] == {
        "type": "response.content_part.added",
        **where,
        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        "sequence_number": 3,
    }
    deltas = evs[4 : 4 + len(pieces)]
    assert [d["delta"] for d in deltas] == pieces
    assert all({k: d[k] for k in where} == where and d["logprobs"] == [] for d in deltas)
    text = "".join(pieces)
    done, part_done, item_done = evs[4 + len(pieces) : -1]
    assert done == {
        **where,
        "type": "response.output_text.done",
        "text": text,
        "logprobs": [],
        "sequence_number": done["sequence_number"],
    }
    assert part_done["part"] == {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    assert item_done["item"] == final["output"][0] and final["output"][0]["content"][0]["text"] == text
    check(final, "Response")
    assert client.get(f"/v1/responses/{final['id']}").json() == final


def test_stream_engine_failure_ends_with_error_then_failed(client, engine):
    engine.error_at_step = 2
    evs = events(client.post("/v1/responses", json={"input": ASK, "stream": True}).text)
    assert [e["type"] for e in evs] == MESSAGE_EVENTS + ["response.output_text.delta"] * 2 + [
        "error",
        "response.failed",
    ]
    assert evs[-2] == {
        "type": "error",
        "code": "server_error",
        "message": "CUDA error",
        "param": None,
        "sequence_number": 6,
    }
    failed = evs[-1]["response"]
    assert (failed["status"], failed["error"], failed["output"]) == (
        "failed",
        {"code": "server_error", "message": "CUDA error"},
        [],
    )
    check(failed, "Response")
    assert engine.running == 0
    assert client.get(f"/v1/responses/{failed['id']}").json() == failed  # no state left in_progress


def test_non_stream_engine_failure_is_a_500(client, engine):
    engine.error_at_step = 1
    r = client.post("/v1/responses", json={"input": ASK})
    assert_error(r, 500, "CUDA error", type="server_error")


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts(tokenizer, stream):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 3

    async def main():
        app = build_app(engine, None)
        return await call_until_disconnect(app, "/v1/responses", {"input": ASK, "stream": stream}, engine.paused)

    sent = asyncio.run(main())
    [(_, _, request_id)] = engine.calls
    assert engine.aborted == [request_id] and engine.completed == [] and engine.running == 0
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if stream:
        assert b"response.output_text.delta" in body and b"response.completed" not in body
    else:
        assert sent[0]["status"] == 499 and body == b""


def test_store_round_trip(client):
    request = {"input": [{"role": "system", "content": "Hi."}, {"type": "message", "role": "user", "content": ASK}]}
    created = client.post("/v1/responses", json=request).json()
    rid = created["id"]
    assert client.get(f"/v1/responses/{rid}").json() == created
    items = client.get(f"/v1/responses/{rid}/input_items").json()
    check(items, "ResponseItemList")
    user, system = items["data"]  # newest first by default
    assert (user["role"], user["content"], user["status"]) == (
        "user",
        [{"type": "input_text", "text": ASK}],
        "completed",
    )
    assert (system["role"], system["content"]) == ("system", [{"type": "input_text", "text": "Hi."}])
    assert items == {
        "object": "list",
        "data": [user, system],
        "first_id": user["id"],
        "last_id": system["id"],
        "has_more": False,
    }
    deleted = client.delete(f"/v1/responses/{rid}")
    assert (deleted.status_code, deleted.json()) == (200, {"id": rid, "object": "response", "deleted": True})
    for r in (
        client.get(f"/v1/responses/{rid}"),
        client.delete(f"/v1/responses/{rid}"),
        client.get(f"/v1/responses/{rid}/input_items"),
        client.post("/v1/responses", json={"input": "more", "previous_response_id": rid}),
    ):
        assert r.status_code == 404 and f"Response with id '{rid}' not found." == r.json()["error"]["message"]


def test_store_false_keeps_nothing(client):
    body = client.post("/v1/responses", json={"input": ASK, "store": False}).json()
    assert body["store"] is False
    assert client.get(f"/v1/responses/{body['id']}").status_code == 404


def test_input_items_pagination(client):
    texts = ["a", "b", "c", "d", "e"]
    rid = client.post("/v1/responses", json={"input": [{"role": "user", "content": t} for t in texts]}).json()["id"]

    def page(**query):
        body = client.get(f"/v1/responses/{rid}/input_items", params=query).json()
        return [i["content"][0]["text"] for i in body["data"]], body["has_more"], body

    ids = {t: i["id"] for t, i in zip(texts, page(order="asc")[2]["data"], strict=True)}
    assert page(order="asc")[:2] == (texts, False)
    assert page()[:2] == (texts[::-1], False)
    assert page(limit=2)[:2] == (["e", "d"], True)
    assert page(limit=2, after=ids["d"])[:2] == (["c", "b"], True)
    assert page(limit=2, order="asc", after=ids["c"])[:2] == (["d", "e"], False)
    r = client.get(f"/v1/responses/{rid}/input_items", params={"limit": 101})
    assert_error(r, 400, "limit must be between 1 and 100.", "limit", "invalid_value")
    r = client.get(f"/v1/responses/{rid}/input_items", params={"order": "up"})
    assert_error(r, 400, "order must be 'asc' or 'desc'.", "order", "invalid_value")
    r = client.get(f"/v1/responses/{rid}/input_items", params={"after": "msg_nope"})
    assert_error(r, 404, "No input item with id 'msg_nope' in this response.", "after")


def test_previous_response_id_replays_every_turn(client, engine, tokenizer):
    first = client.post("/v1/responses", json={"input": "One?", "instructions": "Old rules."}).json()
    second = client.post("/v1/responses", json={"input": "Two?", "previous_response_id": first["id"]}).json()
    third = client.post(
        "/v1/responses",
        json={
            "input": [{"role": "user", "content": "Three?"}],
            "previous_response_id": second["id"],
            "instructions": "New.",
        },
    ).json()
    assert (second["previous_response_id"], third["previous_response_id"]) == (first["id"], second["id"])
    history = [
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": TEXT},
        {"role": "user", "content": "Two?"},
        {"role": "assistant", "content": TEXT},
        {"role": "user", "content": "Three?"},
    ]
    assert engine.calls[1][0] == chat_prompt(tokenizer, history[:3])  # instructions are not carried over
    assert engine.calls[2][0] == chat_prompt(tokenizer, [{"role": "system", "content": "New."}, *history])
    assert third["usage"]["input_tokens"] == len(engine.calls[2][0])
    # input_items lists only the turn's own input
    assert [i["content"][0]["text"] for i in client.get(f"/v1/responses/{third['id']}/input_items").json()["data"]] == [
        "Three?"
    ]


def test_restart_keeps_stored_responses(tokenizer, tmp_path):
    with TestClient(build_app(FakeEngine(tokenizer, [PARIS]), None, tmp_path)) as client:
        first = client.post("/v1/responses", json={"input": "One?"}).json()
    assert (tmp_path / "hybridserve.sqlite3").exists()
    engine = FakeEngine(tokenizer, [PARIS])
    with TestClient(build_app(engine, None, tmp_path)) as client:
        assert client.get(f"/v1/responses/{first['id']}").json() == first
        client.post("/v1/responses", json={"input": "Two?", "previous_response_id": first["id"]})
    history = [
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": TEXT},
        {"role": "user", "content": "Two?"},
    ]
    assert engine.calls[0][0] == chat_prompt(tokenizer, history)


@pytest.mark.parametrize(
    ("body", "status", "message", "param", "code"),
    [
        ({"input": ASK, "model": "gpt-4o"}, 404, "The model `gpt-4o` does not exist.", "model", "model_not_found"),
        ({}, 400, "Missing required parameter: 'input'.", "input", "missing_required_parameter"),
        (
            {"input": ASK, "previous_response_id": "abc"},
            400,
            "Invalid 'previous_response_id': 'abc'. Expected an ID that begins with 'resp_'.",
            "previous_response_id",
            "invalid_value",
        ),
        (
            {"input": ASK, "previous_response_id": "resp_unknown"},
            404,
            "Response with id 'resp_unknown' not found.",
            "previous_response_id",
            "not_found",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": ASK},
                    {"type": "function_call", "call_id": "c", "arguments": "{}"},
                ]
            },
            400,
            "Missing required parameter: 'input[1].name'.",
            "input[1].name",
            None,
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]},
            400,
            "Missing required parameter: 'input[0].output'.",
            "input[0].output",
            None,
        ),
        (
            {"input": [{"type": "item_reference", "id": "msg_nowhere"}]},
            404,
            "Item with id 'msg_nowhere' not found.",
            "input[0].id",
            "not_found",
        ),
        (
            {"input": [{"type": "computer_call_output", "call_id": "c"}]},
            400,
            "Input item type 'computer_call_output' is not supported yet.",
            "input[0].type",
            "unsupported_value",
        ),
        (
            {"input": ASK, "tool_choice": "required"},
            400,
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
            "tool_choice",
            None,
        ),
        (
            {"input": ASK, "tools": [{"type": "function", "name": "a b"}]},
            400,
            "Invalid 'tools[0].name': 'a b'. Expected a string of 1 to 64 letters, digits, underscores or dashes.",
            "tools[0].name",
            "invalid_value",
        ),
        (
            {"input": ASK, "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]},
            400,
            "Duplicate function name 'f' in tools.",
            "tools[1].name",
            None,
        ),
        (
            {
                "input": ASK,
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            400,
            "tool_choice names function 'g', which is not in tools.",
            "tool_choice",
            None,
        ),
        (
            {"input": ASK, "tool_choice": "sometimes"},
            400,
            "Invalid value for 'tool_choice': 'sometimes'. Expected one of auto, none, required, "
            "or a function to call.",
            "tool_choice",
            "invalid_value",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            400,
            "Content part type 'input_image' is not supported yet.",
            "input[0].content[0].type",
            "unsupported_value",
        ),
        (
            {"input": [{"role": "tool", "content": "x"}]},
            400,
            "Invalid value for 'input[0].role': expected one of user, assistant, system, developer.",
            "input[0].role",
            None,
        ),
        ({"input": []}, 400, "input must contain at least one item.", "input", "invalid_value"),
        (
            {"input": ASK, "max_output_tokens": 0},
            400,
            "max_output_tokens must be at least 1, got 0",
            "max_output_tokens",
            "invalid_value",
        ),
    ],
)
def test_errors(client, engine, body, status, message, param, code):
    assert_error(client.post("/v1/responses", json=body), status, message, param, code)
    assert engine.calls == []


def test_retrieve_and_delete_errors(client):
    for method in ("get", "delete"):
        r = getattr(client, method)("/v1/responses/abc")
        assert_error(
            r,
            400,
            "Invalid 'response_id': 'abc'. Expected an ID that begins with 'resp_'.",
            "response_id",
            "invalid_value",
        )
        r = getattr(client, method)("/v1/responses/resp_nope")
        assert_error(r, 404, "Response with id 'resp_nope' not found.", code="not_found")
    r = client.get("/v1/responses/abc/input_items")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"


def expected_logprobs(engine, tokens: list[int], k: int, first_position: int = 0) -> list[dict]:
    """The fake engine's exact logprobs for `tokens` at consecutive positions, in the Responses shape."""
    out = []
    for position, token in enumerate(tokens, start=first_position):
        lp = engine.logprob(token, position, k)
        top = [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top]
        out.append({"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes, "top_logprobs": top})
    return out


def test_logprobs_when_included(client, engine):
    body = {"input": ASK, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = client.post("/v1/responses", json=body).json()
    check(response, "Response")
    assert response["top_logprobs"] == 2
    part = response["output"][0]["content"][0]
    assert part["logprobs"] == expected_logprobs(engine, PARIS[:7], 2)  # EOS has no text and no logprob here
    assert engine.calls[0][1].logprobs == 2
    evs = events(client.post("/v1/responses", json={**body, "stream": True}).text)
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert [d["logprobs"] for d in deltas] == [[lp] for lp in expected_logprobs(engine, PARIS[:7], 2)]
    done = next(e for e in evs if e["type"] == "response.output_text.done")
    assert done["logprobs"] == part["logprobs"]


def test_no_logprobs_unless_asked(client, engine):
    response = client.post("/v1/responses", json={"input": ASK}).json()
    assert response["output"][0]["content"][0]["logprobs"] == [] and engine.calls[0][1].logprobs is None
