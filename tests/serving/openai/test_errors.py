import pytest
from fastapi.testclient import TestClient

from hybridserve.sampling_params import InvalidParameter
from hybridserve.serving.app import build_app
from hybridserve.serving.openai.errors import MAX_JSON_DEPTH
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, QUESTION, assert_error, error_body, sse_payloads

CHAT = "/v1/chat/completions"


def chat(**fields):
    return {"messages": QUESTION, **fields}


def test_malformed_json(client):
    r = client.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, "We could not parse the JSON body of your request. The body must be a valid JSON object.")
    assert_error(
        client.post(CHAT, content=b""),
        400,
        "We could not parse the JSON body of your request. The body must be a valid JSON object.",
    )


def test_a_body_nested_past_the_parsers_depth_is_refused_naming_the_limit(client):
    def nested(depth: int) -> bytes:  # the body's object, then arrays in arrays
        arrays = depth - 1
        return b'{"messages": [{"role": "user", "content": "hi"}], "stop": ' + b"[" * arrays + b"]" * arrays + b"}"

    too_deep = f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep (objects and arrays), deeper than "
    too_deep += "this server parses."
    headers = {"content-type": "application/json"}
    assert_error(
        client.post(CHAT, content=nested(MAX_JSON_DEPTH + 1), headers=headers), 400, too_deep, code="json_too_deep"
    )
    assert_error(client.post(CHAT, content=nested(900), headers=headers), 400, too_deep, code="json_too_deep")
    r = client.post(CHAT, content=nested(MAX_JSON_DEPTH), headers=headers)  # parsed: the field's own error
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.json()


def test_body_must_be_an_object(client):
    assert_error(client.post(CHAT, json=[1, 2]), 400, "The request body must be a JSON object.")


@pytest.mark.parametrize(
    ("body", "message", "param", "code"),
    [
        ({}, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"),
        (
            {"messages": [{"role": "user"}], "temperature": "hot"},
            "Invalid value for 'temperature': Input should be a valid number, got \"hot\".",
            "temperature",
            "invalid_type",
        ),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "Invalid value for 'messages[0].content': Input should be a valid string, got 5.",
            "messages[0].content",
            "invalid_type",
        ),
        (
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "Invalid value for 'messages[0].role': Input should be 'system', 'developer', 'user', "
            "'assistant' or 'tool', got \"wizard\".",
            "messages[0].role",
            "invalid_value",
        ),
        (
            {"messages": [{"content": "hi"}]},
            "Missing required parameter: 'messages[0].role'.",
            "messages[0].role",
            "missing_required_parameter",
        ),
    ],
)
def test_validation_errors_name_the_field(client, body, message, param, code):
    assert_error(client.post(CHAT, json=body), 400, message, param, code)


def test_unknown_model_is_404(client):
    assert_error(
        client.post(CHAT, json=chat(model="gpt-4o")),
        404,
        "The model `gpt-4o` does not exist.",
        "model",
        "model_not_found",
    )
    assert_error(
        client.post("/v1/completions", json={"model": "x", "prompt": "hi"}),
        404,
        "The model `x` does not exist.",
        "model",
        "model_not_found",
    )
    assert_error(client.get("/v1/models/x"), 404, "The model `x` does not exist.", "model", "model_not_found")


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"temperature": -1}, "temperature must be in [0, 2], got -1.0", "temperature"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0", "top_p"),
        ({"n": 0}, "n must be in [1, 128], got 0", "n"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0", "max_tokens"),
        (
            {"max_completion_tokens": 0},
            "max_completion_tokens must be at least 1, got 0",
            "max_completion_tokens",
        ),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20], got 21", "top_logprobs"),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0", "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids, got 'x'", "logit_bias"),
        (
            {"logit_bias": {"99999999": 1}},
            "logit_bias contains token id 99999999, outside [0, 49152)",
            "logit_bias",
        ),
        ({"stop": ["", "a"]}, "stop must not contain empty strings, got ''", "stop"),
        (
            {"min_tokens": 5, "max_tokens": 2},
            "min_tokens must not exceed max_tokens (2), got 5",
            "min_tokens",
        ),
    ],
)
def test_invalid_parameters_name_the_parameter(client, fields, message, param):
    assert_error(client.post(CHAT, json=chat(**fields)), 400, message, param, "invalid_value")


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs requires logprobs to be true.", "top_logprobs"),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options is only allowed when stream is true.",
            "stream_options",
        ),
        ({"messages": []}, "messages must contain at least one message.", "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "Only text content parts are supported, got type 'image_url'.",
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "A text content part needs a 'text' field.",
            "messages[0].content[0].text",
        ),
    ],
)
def test_unsupported_requests(client, fields, message, param):
    assert_error(client.post(CHAT, json=chat(**fields)), 400, message, param)


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"suffix": "end"}, "suffix is not supported by this server.", "suffix"),
        ({"best_of": 3}, "best_of is not supported by this server (it must equal n).", "best_of"),
        ({"prompt": []}, "prompt must not be empty.", "prompt"),
        ({"prompt": ""}, "prompt must not be empty.", "prompt"),
        ({"prompt": [[1], []]}, "prompt[1] must not be empty.", "prompt"),
    ],
)
def test_unsupported_completion_requests(client, fields, message, param):
    assert_error(client.post("/v1/completions", json={"prompt": "hi", **fields}), 400, message, param)


def test_completion_token_ids_outside_vocabulary(client):
    assert_error(
        client.post("/v1/completions", json={"prompt": [1, 49152]}),
        400,
        "prompt contains token id 49152, outside the vocabulary [0, 49152).",
        "prompt",
        "invalid_value",
    )


def test_context_length(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS], max_model_len=40)
    client = TestClient(build_app(engine, None))
    assert_error(
        client.post(CHAT, json=chat(max_tokens=10)),
        400,
        "This model's maximum context length is 40 tokens. However, you requested 47 tokens (37 in the "
        "messages, 10 in the completion). Please reduce the length of the messages or completion.",
        "max_tokens",
        "context_length_exceeded",
    )
    assert_error(
        client.post(CHAT, json=chat(max_completion_tokens=4)),
        400,
        "This model's maximum context length is 40 tokens. However, you requested 41 tokens (37 in the "
        "messages, 4 in the completion). Please reduce the length of the messages or completion.",
        "max_completion_tokens",
        "context_length_exceeded",
    )
    long = [{"role": "user", "content": "word " * 40}]
    r = client.post(CHAT, json={"messages": long})
    prompt_len = len(
        tokenizer.encode(
            tokenizer.apply_chat_template(long, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
    )
    assert_error(
        r,
        400,
        f"This model's maximum context length is 40 tokens. However, your messages resulted in "
        f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length of the "
        "messages.",
        "messages",
        "context_length_exceeded",
    )
    assert_error(
        client.post("/v1/completions", json={"prompt": list(range(1, 39)), "max_tokens": 3}),
        400,
        "This model's maximum context length is 40 tokens. However, you requested 41 tokens (38 in the "
        "prompt, 3 in the completion). Please reduce the length of the prompt or completion.",
        "max_tokens",
        "context_length_exceeded",
    )
    assert_error(
        client.post(CHAT, json=chat(min_tokens=5)),
        400,
        "min_tokens must not exceed max_tokens (3), got 5",
        "min_tokens",
        "invalid_value",
    )
    assert engine.calls == []


def test_engine_rejection_is_400(client, engine):
    engine.reject = InvalidParameter("prompt", "prompt is too long for the engine")
    assert_error(client.post(CHAT, json=chat()), 400, "prompt is too long for the engine", "prompt")


def test_engine_error_non_stream_is_500(client, engine):
    engine.error_at_step = 2
    assert_error(client.post(CHAT, json=chat()), 500, "CUDA error", type="server_error")
    engine.error_at_step, engine.raise_at_step = None, 1
    assert_error(
        client.post(CHAT, json=chat()),
        500,
        "The engine failed to serve the request: engine process died",
        type="server_error",
    )


def test_engine_error_stream_ends_with_error_chunk_then_done(client, engine):
    engine.error_at_step = 2
    events = sse_payloads(client.post(CHAT, json=chat(stream=True)).text)
    assert [e["choices"][0]["delta"] for e in events[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "The"},
        {"content": " capital"},
    ]
    assert events[3:] == [error_body("CUDA error", "server_error"), "[DONE]"]
    engine.error_at_step, engine.raise_at_step = None, 0
    events = sse_payloads(client.post("/v1/completions", json={"prompt": "hi", "stream": True}).text)
    assert events == [
        error_body("The engine failed to serve the request: engine process died", "server_error"),
        "[DONE]",
    ]


def test_engine_abort_while_client_connected_is_an_error(client, engine, monkeypatch):
    from hybridserve.engine.outputs import CompletionOutput, RequestOutput

    async def aborted(prompt, params, request_id, priority=0):
        yield RequestOutput(request_id, len(prompt), 0, CompletionOutput(0, "", [], None, "", 0, "abort"), True)

    monkeypatch.setattr(engine, "generate", aborted)
    assert_error(
        client.post(CHAT, json=chat()),
        500,
        "The engine aborted the request before it finished.",
        type="server_error",
    )


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nope"), 404, "Not Found")
    assert_error(client.get(CHAT), 405, "Method Not Allowed")


def test_api_key(tokenizer):
    client = TestClient(build_app(FakeEngine(tokenizer, [PARIS]), "sk-test"))
    missing = "Missing API key: send it as 'Authorization: Bearer <key>'."
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", CHAT),
        ("POST", "/v1/completions"),
        ("GET", "/v1/anything"),
    ]:
        r = client.request(method, path, json=chat())
        assert_error(r, 401, missing, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        r = client.request(method, path, json=chat(), headers={"Authorization": "Bearer sk-wrong"})
        assert_error(r, 401, "Incorrect API key provided.", code="invalid_api_key")
    ok = {"Authorization": "Bearer sk-test"}
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.post(CHAT, json=chat(), headers=ok).status_code == 200
    for path in ["/health", "/metrics", "/version"]:
        assert client.get(path).status_code == 200
