"""The prompt rule the frontend (`fanout.expand`) and the engine (`EngineCore`) share: one check, one message."""

from __future__ import annotations


def prompt_problem(num_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt of `num_tokens` tokens cannot run within `max_model_len`; None when it can."""
    if num_tokens == 0:
        return "the prompt is empty"
    if num_tokens >= max_model_len:
        return (
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_tokens} tokens, which leaves no room to generate"
        )
    return None
