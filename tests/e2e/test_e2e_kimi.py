"""End to end: `hybridserve serve path/to/kimi-linear-tiny` (a hybrid KDA + MLA model) answers Chat
Completions through the openai SDK, streamed and not, with the same greedy text either way; kimi-k3-tiny is
served through the Kimi-K3 extension."""

from __future__ import annotations

import openai

from hybridserve.rendering.kimi_k3 import ASSISTANT_OPEN, RESPONSE_OPEN
from scripts.make_tiny_checkpoints import k3_tokenizer
from tests.e2e.test_e2e_server import KEY, running_server


def test_serve_kimi_linear_tiny_chat_completions(kimi_linear_dir, tmp_path):
    with running_server(tmp_path / "server.log", str(kimi_linear_dir)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        [model] = client.models.list().data
        messages = [{"role": "user", "content": "Hello, hybrid model!"}]
        r = client.chat.completions.create(model=model.id, messages=messages, temperature=0, max_tokens=16)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert 0 < r.usage.completion_tokens <= 16
        chunks = client.chat.completions.create(
            model=model.id, messages=messages, temperature=0, max_tokens=16, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == r.choices[0].message.content


def test_serve_kimi_k3_tiny_responses_and_chat(kimi_k3_dir, tmp_path):
    """kimi-k3-tiny (model_type kimi_k3) is served with the Kimi-K3 extension: its renderer builds the prompt
    (read back through return_token_ids) and its parsers read the random model's output without failing."""
    with running_server(tmp_path / "server.log", str(kimi_k3_dir)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        [model] = client.models.list().data
        r = client.responses.create(
            model=model.id,
            input="Hello, K3!",
            reasoning={"effort": "none"},
            max_output_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        prompt = r.model_extra["prompt_token_ids"]
        opened = k3_tokenizer().encode(ASSISTANT_OPEN + RESPONSE_OPEN, add_special_tokens=False)
        assert prompt[-len(opened) :] == opened and r.status in ("completed", "incomplete")
        assert r.usage.output_tokens == len(r.model_extra["output_token_ids"]) <= 8
        chat = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "Hello, K3!"}],
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True, "reasoning_effort": "high"},
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert len(chat.model_extra["prompt_token_ids"]) > len(prompt)  # the thinking-effort block
