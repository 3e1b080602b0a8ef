import re

from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import sse_payloads
from tests.serving.openapi_schema import check

PROMPT = "The capital of France is"
PARIS_END = [7042, 30, 2]  # " Paris." then EOS


def make_client(tokenizer, scripts=(PARIS_END,)):
    engine = FakeEngine(tokenizer, list(scripts))
    return engine, TestClient(build_app(engine, None))


def test_non_stream_body_is_exact(tokenizer):
    engine, client = make_client(tokenizer)
    r = client.post("/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 5})
    body = r.json()
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    prompt_ids = tokenizer.encode(PROMPT)
    assert body == {
        "id": body["id"],
        "object": "text_completion",
        "created": body["created"],
        "model": "smollm2",
        "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": 3,
            "total_tokens": len(prompt_ids) + 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    check(body, "CreateCompletionResponse")
    assert engine.calls[0][0] == prompt_ids and engine.calls[0][2] == body["id"]


def test_batch_of_strings_indexes_choices_per_prompt_times_n(tokenizer):
    engine, client = make_client(tokenizer, [PARIS_END, [30, 2]])
    r = client.post("/v1/completions", json={"prompt": ["a b", "c"], "n": 2, "max_tokens": 5})
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, " Paris."),
        (1, "."),
        (2, " Paris."),
        (3, "."),
    ]
    a, c = tokenizer.encode("a b"), tokenizer.encode("c")
    # One engine request per prompt and choice: prompt k's engine request id, then "-<choice>".
    ids = [(a, body["id"] + "-0-0"), (a, body["id"] + "-0-1"), (c, body["id"] + "-1-0"), (c, body["id"] + "-1-1")]
    assert [(p, rid) for p, _, rid in engine.calls] == ids
    assert body["usage"]["prompt_tokens"] == len(a) + len(c)
    assert body["usage"]["completion_tokens"] == 2 * (3 + 2)
    check(body, "CreateCompletionResponse")


def test_token_id_prompts(tokenizer):
    engine, client = make_client(tokenizer)
    r = client.post("/v1/completions", json={"prompt": [504, 3575], "max_tokens": 4})
    assert r.status_code == 200 and engine.calls[-1][0] == [504, 3575]
    r = client.post("/v1/completions", json={"prompt": [[504], [282, 4649]], "max_tokens": 4})
    assert r.status_code == 200
    assert [c[0] for c in engine.calls[-2:]] == [[504], [282, 4649]]
    assert len(r.json()["choices"]) == 2


def test_default_max_tokens_fills_context_per_prompt(tokenizer):
    engine, client = make_client(tokenizer)
    client.post("/v1/completions", json={"prompt": [[504], [282, 4649]]})
    assert [params.max_tokens for _, params, _ in engine.calls] == [255, 254]


def test_echo(tokenizer):
    engine, client = make_client(tokenizer)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 5})
    assert r.json()["choices"][0]["text"] == PROMPT + " Paris."
    r = client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "stream": True, "max_tokens": 5})
    texts = [c["choices"][0]["text"] for c in sse_payloads(r.text)[:-1]]
    assert texts == [PROMPT, " Paris", ".", ""]


def test_stream_chunk_sequence_is_exact(tokenizer):
    engine, client = make_client(tokenizer)
    r = client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "stream": True, "max_tokens": 5, "stream_options": {"include_usage": True}},
    )
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    head = {
        "id": chunks[0]["id"],
        "object": "text_completion",
        "created": chunks[0]["created"],
        "model": "smollm2",
        "usage": None,
    }

    def choice(text, finish_reason=None, **extra):
        return {
            **head,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, **extra}],
        }

    n = len(tokenizer.encode(PROMPT))
    assert chunks == [
        choice(" Paris"),
        choice("."),
        choice("", "stop", stop_reason=None),
        {
            **head,
            "choices": [],
            "usage": {
                "prompt_tokens": n,
                "completion_tokens": 3,
                "total_tokens": n + 3,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        },
    ]
    # The schema is shared with non-streamed responses and so has no null finish_reason (nor usage), but
    # OpenAI's streams send null until a choice's last chunk, as do we.
    for chunk in chunks:
        shaped = {k: v for k, v in chunk.items() if k != "usage" or v is not None}
        shaped["choices"] = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
        check(shaped, "CreateCompletionResponse")


def test_logprobs_shape(tokenizer):
    engine, client = make_client(tokenizer)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 1, "max_tokens": 2})
    body = r.json()
    check(body, "CreateCompletionResponse")
    paris, dot = tokenizer.decode([7042]), tokenizer.decode([30])
    assert body["choices"][0]["logprobs"] == {
        "tokens": [paris, dot],
        "token_logprobs": [-0.125, -0.25],
        "top_logprobs": [{paris: -0.125}, {dot: -0.25}],
        "text_offset": [0, len(paris)],
    }
    r = client.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 2, "max_tokens": 2, "stream": True})
    logprobs = [c["choices"][0]["logprobs"] for c in sse_payloads(r.text)[:-1]]
    second = tokenizer.decode([7043])
    assert logprobs == [
        {
            "tokens": [paris],
            "token_logprobs": [-0.125],
            "top_logprobs": [{paris: -0.125, second: -1.125}],
            "text_offset": [0],
        },
        {
            "tokens": [dot],
            "token_logprobs": [-0.25],
            "top_logprobs": [{dot: -0.25, tokenizer.decode([31]): -1.25}],
            "text_offset": [len(paris)],
        },
        None,
    ]


def _prompt_entries(engine, ids: list[int], k: int) -> list:
    """What the fake engine reports for the prompt: token 0 without a logprob, then its synthetic ones."""
    return [None, *(engine.logprob(t, p, k) for p, t in enumerate(ids[1:], start=1))]


def test_echo_with_logprobs_scores_the_prompt_then_the_output(tokenizer):
    """OpenAI's legacy scoring (what lm-evaluation-harness sends for loglikelihood): the prompt's tokens come
    first, the first with null logprob and alternatives, then the generated ones, offsets running on."""
    engine, client = make_client(tokenizer)
    ids = tokenizer.encode(PROMPT)
    r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1})
    body = r.json()  # (OpenAI's schema types token_logprobs as numbers, though its API sends the first as null)
    assert engine.calls[0][1].prompt_logprobs == 1
    texts = [tokenizer.decode([t]) for t in ids]
    paris = tokenizer.decode([7042])
    expected_prompt = _prompt_entries(engine, ids, 1)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [*texts, paris]
    assert logprobs["token_logprobs"] == [None, *(lp.logprob for lp in expected_prompt[1:]), -0.125]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1:] == [
        *({lp.token: lp.logprob} for lp in expected_prompt[1:]),
        {paris: -0.125},
    ]
    offsets = [sum(map(len, texts[:i])) for i in range(len(texts) + 1)]
    assert logprobs["text_offset"] == offsets
    assert body["choices"][0]["text"] == tokenizer.decode(ids) + paris


def test_max_tokens_zero_with_echo_returns_the_prompt_only(tokenizer):
    engine, client = make_client(tokenizer)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0})
    body = r.json()
    ids = tokenizer.encode(PROMPT)
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert body["usage"]["completion_tokens"] == 0
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens must be non-negative, got -1"


def test_vllm_prompt_logprobs_field(tokenizer):
    engine, client = make_client(tokenizer)
    ids = tokenizer.encode(PROMPT)
    r = client.post("/v1/completions", json={"prompt": ids, "prompt_logprobs": 2, "max_tokens": 1})
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and choice["text"] == " Paris"
    expected = [None] + [
        {
            str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
            for rank, t in enumerate(lp.top, 1)
        }
        for lp in _prompt_entries(engine, ids, 2)[1:]
    ]
    assert choice["prompt_logprobs"] == expected
    r = client.post("/v1/completions", json={"prompt": ids, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_streamed_echo_with_logprobs(tokenizer):
    engine, client = make_client(tokenizer)
    ids = tokenizer.encode(PROMPT)
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True}
    chunks = sse_payloads(client.post("/v1/completions", json=body).text)[:-1]
    first, second = chunks[0]["choices"][0], chunks[1]["choices"][0]
    texts = [tokenizer.decode([t]) for t in ids]
    assert first["text"] == tokenizer.decode(ids)
    assert first["logprobs"]["tokens"] == texts and first["logprobs"]["token_logprobs"][0] is None
    assert second["text"] == " Paris" and second["logprobs"]["text_offset"] == [sum(map(len, texts))]


def test_chat_prompt_logprobs(tokenizer):
    from tests.serving.helpers import QUESTION, chat_prompt

    engine, client = make_client(tokenizer)
    body = {"messages": QUESTION, "prompt_logprobs": 0, "max_tokens": 1}
    r = client.post("/v1/chat/completions", json=body)
    ids = chat_prompt(tokenizer)
    prompt = r.json()["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    assert prompt[1] == {str(ids[1]): {"logprob": -0.25, "rank": 1, "decoded_token": tokenizer.decode([ids[1]])}}
    chunks = sse_payloads(client.post("/v1/chat/completions", json={**body, "stream": True}).text)[:-1]
    assert [c.get("prompt_logprobs") for c in chunks] == [None, None, prompt]
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens must be at least 1, got 0"
