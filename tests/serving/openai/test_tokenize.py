"""POST /tokenize and /detokenize (vLLM's shapes): the ids are those the engine receives for the same prompt."""

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from tests.serving.helpers import QUESTION, assert_error, chat_prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def tokenize(client, **body) -> dict:
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_completion_prompt_tokenizes_to_the_ids_the_engine_gets(client, engine, tokenizer):
    out = tokenize(client, model="smollm2", prompt="Hello world, what a day")
    assert (
        client.post("/v1/completions", json={"prompt": "Hello world, what a day", "max_tokens": 1}).status_code == 200
    )
    [(served, _, _)] = engine.calls
    assert out == {"count": len(served), "max_model_len": 256, "tokens": served, "token_strs": None}
    assert served == tokenizer.encode("Hello world, what a day")


def test_add_special_tokens_false_tokenizes_the_text_alone(client, tokenizer):
    out = tokenize(client, prompt="Hello world", add_special_tokens=False)
    assert out["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)


def test_token_strs_are_the_vocabulary_entries(client, tokenizer):
    out = tokenize(client, prompt="Hello world", return_token_strs=True)
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert out["token_strs"][-1] == "Ġworld"  # byte-level BPE: the space is part of the token


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS},  # SmolLM2's template knows no tools: they are written into the prompt (Hermes)
        {"chat_template_kwargs": {"add_generation_prompt": False}},  # the template's kwarg wins, in both
    ],
    ids=["plain", "tools", "kwargs"],
)
def test_a_chat_tokenizes_to_the_prompt_ids_of_a_chat_completion(client, engine, tokenizer, extra):
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    out = tokenize(client, messages=messages, return_token_strs=True, **extra)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    [(served, _, _)] = engine.calls
    assert out["tokens"] == served and out["count"] == len(served)
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(served)
    if not extra:
        assert served == chat_prompt(tokenizer, messages)


def test_a_chat_without_the_generation_prompt(client, tokenizer):
    out = tokenize(client, messages=QUESTION, add_generation_prompt=False)
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=False, tokenize=False)
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert out["tokens"] != chat_prompt(tokenizer)


def test_continue_final_message_ends_with_the_partial_answer(client):
    messages = [*QUESTION, {"role": "assistant", "content": "The capital is"}]
    out = tokenize(client, messages=messages, add_generation_prompt=False, continue_final_message=True)
    text = client.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe capital is")


def test_continue_final_message_needs_no_generation_prompt(client):
    r = client.post("/tokenize", json={"messages": QUESTION, "continue_final_message": True})
    message = (
        "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt to false "
        "to continue the final message."
    )
    assert_error(r, 400, message, param="continue_final_message")


def test_prompt_and_messages_exactly_one(client):
    r = client.post("/tokenize", json={"prompt": "Hi", "messages": QUESTION})
    assert_error(r, 400, "Send either 'prompt' or 'messages', not both.", param="messages")
    r = client.post("/tokenize", json={"add_special_tokens": True})
    message = "Missing required parameter: 'prompt' (a completion prompt) or 'messages' (a chat)."
    assert_error(r, 400, message, param="prompt", code="missing_required_parameter")


def test_a_chat_the_template_cannot_render_is_a_400_on_messages(client):
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert_error(r, 400, "Only text content parts are supported, got type 'image_url'.", param="messages[0].content[0]")


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_another_model_is_the_404_of_every_endpoint(client, path):
    r = client.post(path, json={"model": "gpt-4o", "prompt": "Hi", "tokens": [1]})
    assert_error(r, 404, "The model `gpt-4o` does not exist.", param="model", code="model_not_found")


def test_detokenize_inverts_tokenize(client, tokenizer):
    for text in ("Hello world, what a day", "Ünïcödé ✓ 日本語"):
        tokens = tokenize(client, prompt=text, add_special_tokens=False)["tokens"]
        assert client.post("/detokenize", json={"model": "smollm2", "tokens": tokens}).json() == {"prompt": text}
    chat = tokenize(client, messages=QUESTION)["tokens"]
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert client.post("/detokenize", json={"tokens": chat}).json() == {"prompt": text}  # special tokens kept
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_an_id_outside_the_vocabulary_is_a_400_naming_it(client, tokenizer, bad):
    vocab = len(tokenizer)
    token_id = vocab if bad == "vocab" else bad
    r = client.post("/detokenize", json={"tokens": [1, token_id]})
    message = f"tokens contains token id {token_id}, outside the vocabulary [0, {vocab})."
    assert_error(r, 400, message, param="tokens", code="invalid_value")


def test_bodies_are_checked_like_every_request(client):
    r = client.post("/detokenize", json={"tokens": ["a"]})
    assert_error(
        r,
        400,
        "Invalid value for 'tokens[0]': Input should be a valid integer, got \"a\".",
        "tokens[0]",
        "invalid_type",
    )
    r = client.post("/detokenize", json={})
    assert_error(r, 400, "Missing required parameter: 'tokens'.", param="tokens", code="missing_required_parameter")


def test_an_api_key_guards_them(engine):
    with TestClient(build_app(engine, "secret")) as client:
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
            r = client.post(path, json=body)
            assert r.status_code == 401
            assert client.post(path, json=body, headers={"Authorization": "Bearer secret"}).status_code == 200
