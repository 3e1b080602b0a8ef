"""End to end: `hybridserve serve path/to/kimi-linear-tiny` (a hybrid KDA + MLA model) answers Chat
Completions through the openai SDK, streamed and not, with the same greedy text either way."""

from __future__ import annotations

import openai

from tests.serving.test_e2e_server import KEY, running_server


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
