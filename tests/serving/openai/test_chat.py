import re
import time

from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, PARIS_PIECES, QUESTION, chat_prompt, sse_payloads
from tests.serving.openapi_schema import check

USAGE_37_8 = {
    "prompt_tokens": 37,
    "completion_tokens": 8,
    "total_tokens": 45,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def test_non_stream_body_is_exact(client, engine, tokenizer):
    r = client.post("/v1/chat/completions", json={"model": "smollm2", "messages": QUESTION})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert abs(body["created"] - time.time()) < 10
    assert body == {
        "id": body["id"],
        "object": "chat.completion",
        "created": body["created"],
        "model": "smollm2",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "The capital of France is Paris.",
                    "refusal": None,
                },
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": USAGE_37_8,
    }
    check(body, "CreateChatCompletionResponse")
    [(prompt, params, request_id)] = engine.calls
    assert prompt == chat_prompt(tokenizer) and len(prompt) == 37
    assert request_id == body["id"]
    assert params.max_tokens == engine.max_model_len - 37  # absent max_tokens: what fits
    assert engine.completed == [body["id"]] and engine.aborted == []


def test_request_fields_map_to_sampling_params(client, engine):
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": QUESTION,
            "max_completion_tokens": 20,
            "max_tokens": 99,
            "temperature": 0.5,
            "top_p": 0.9,
            "n": 1,
            "stop": "Paris",
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logit_bias": {"2": -100},
            "user": "u1",
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [7],
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "some_future_field": {"ignored": True},
        },
    )
    assert r.status_code == 200, r.text
    params = engine.calls[0][1]
    assert (params.max_tokens, params.temperature, params.top_p, params.stop, params.seed) == (
        20,
        0.5,
        0.9,
        ("Paris",),
        7,
    )
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.5, -0.5, {2: -100.0})
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (40, 0.05, 1.1, 2)
    assert (params.ignore_eos, params.stop_token_ids, params.skip_special_tokens) == (True, (7,), False)
    assert params.include_stop_str_in_output and params.logprobs is None
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris"
    assert r.json()["choices"][0]["stop_reason"] == "Paris"


def test_content_parts_and_template_kwargs(client, engine, tokenizer):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi", "name": "ann"},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}},
    )
    assert r.status_code == 200, r.text
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Hi", "name": "ann"}],
        add_generation_prompt=False,
        tokenize=False,
    )
    assert engine.calls[0][0] == tokenizer.encode(rendered, add_special_tokens=False)


def test_stream_chunk_sequence_is_exact(client):
    r = client.post(
        "/v1/chat/completions",
        json={"messages": QUESTION, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    head = {
        "id": chunks[0]["id"],
        "object": "chat.completion.chunk",
        "created": chunks[0]["created"],
        "model": "smollm2",
        "usage": None,
    }
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", head["id"])

    def choice(delta, finish_reason=None, **extra):
        return {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, **extra}],
        }

    assert chunks == [
        choice({"role": "assistant", "content": ""}),
        *[choice({"content": piece}) for piece in PARIS_PIECES],
        choice({}, "stop", stop_reason=None),
        {**head, "choices": [], "usage": USAGE_37_8},
    ]
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")


def test_stream_without_usage_has_no_usage_field(client):
    r = client.post("/v1/chat/completions", json={"messages": QUESTION, "stream": True, "max_tokens": 3})
    chunks = sse_payloads(r.text)[:-1]
    assert all("usage" not in c for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "The"},
        {"content": " capital"},
        {"content": " of"},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n2_indices_stream_and_not(tokenizer):
    from fastapi.testclient import TestClient

    from hybridserve.serving.app import build_app

    hello = tokenizer.encode("Hello there!", add_special_tokens=False) + [2]
    engine = FakeEngine(tokenizer, [PARIS, hello])
    with TestClient(build_app(engine, None)) as client:
        r = client.post("/v1/chat/completions", json={"messages": QUESTION, "n": 2})
        body = r.json()
        assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [
            (0, "The capital of France is Paris."),
            (1, "Hello there!"),
        ]
        assert body["usage"]["completion_tokens"] == len(PARIS) + len(hello)
        assert body["usage"]["prompt_tokens"] == 37  # the prompt counts once, whatever n is
        check(body, "CreateChatCompletionResponse")

        r = client.post("/v1/chat/completions", json={"messages": QUESTION, "n": 2, "stream": True})
        chunks = sse_payloads(r.text)[:-1]
        assert [c["choices"][0] for c in chunks[:2]] == [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in (0, 1)
        ]
        for i, expected in enumerate(["The capital of France is Paris.", "Hello there!"]):
            mine = [c["choices"][0] for c in chunks[2:] if c["choices"][0]["index"] == i]
            assert "".join(c["delta"].get("content", "") for c in mine) == expected
            assert [c["finish_reason"] for c in mine][-1] == "stop"
            assert all(c["finish_reason"] is None for c in mine[:-1])


def test_logprobs_shapes(client, engine):
    r = client.post(
        "/v1/chat/completions",
        json={"messages": QUESTION, "logprobs": True, "top_logprobs": 2, "max_tokens": 2},
    )
    body = r.json()
    check(body, "CreateChatCompletionResponse")

    def entry(token_id, position):
        lp = engine.logprob(token_id, position, 2)
        return {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": lp.bytes,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top],
        }

    assert body["choices"][0]["logprobs"] == {"content": [entry(504, 0), entry(3575, 1)], "refusal": None}
    assert body["choices"][0]["logprobs"]["content"][1] == {
        "token": " capital",
        "logprob": -0.25,
        "bytes": list(b" capital"),
        "top_logprobs": [
            {"token": " capital", "logprob": -0.25, "bytes": list(b" capital")},
            {
                "token": engine.tokenizer.decode([3576]),
                "logprob": -1.25,
                "bytes": list(engine.tokenizer.decode([3576]).encode()),
            },
        ],
    }

    r = client.post(
        "/v1/chat/completions", json={"messages": QUESTION, "logprobs": True, "max_tokens": 2, "stream": True}
    )
    chunks = sse_payloads(r.text)[:-1]
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")
    assert [c["choices"][0]["logprobs"] for c in chunks] == [
        None,
        {
            "content": [{"token": "The", "logprob": -0.125, "bytes": list(b"The"), "top_logprobs": []}],
            "refusal": None,
        },
        {
            "content": [{"token": " capital", "logprob": -0.25, "bytes": list(b" capital"), "top_logprobs": []}],
            "refusal": None,
        },
        None,
    ]
    assert engine.calls[-1][1].logprobs == 0


def test_cached_tokens_reported(client, engine):
    engine.cached_tokens = 32
    r = client.post("/v1/chat/completions", json={"messages": QUESTION})
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
