"""A request with n > 1 becomes n engine requests that share the prompt (and so its cached blocks)."""

from __future__ import annotations

import dataclasses
import time

from hybridserve.engine.prompt_limits import prompt_problem
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.engine.structured_output import check
from hybridserve.sampling_params import InvalidParameter, SamplingParams


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{index}"


def expand(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: list[int],
    max_model_len: int,
    priority: int = 0,
) -> list[EngineCoreRequest]:
    """One engine request per choice, after checking what the engine would reject (raises InvalidParameter).
    A seeded request gives choice i the seed seed + i, so the choices
    differ from each other and each is reproducible. `priority`: the scheduler's (lower first; online 0)."""
    n_prompt = len(prompt_token_ids)
    if (problem := prompt_problem(n_prompt, max_model_len)) is not None:
        raise InvalidParameter("prompt", problem)
    if params.max_tokens is not None and n_prompt + params.max_tokens > max_model_len:
        raise InvalidParameter(
            "max_tokens",
            f"this model's maximum context length is {max_model_len} tokens, but {n_prompt} "
            f"prompt tokens plus max_tokens={params.max_tokens} would need {n_prompt + params.max_tokens}",
        )
    if params.structured_output is not None:  # a bad schema or grammar is the caller's error, not the engine's
        check(params.structured_output)
    now = time.time()
    children = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        child = dataclasses.replace(params, n=1, seed=seed)
        children.append(
            EngineCoreRequest(child_id(request_id, i, params.n), prompt_token_ids, child, eos_token_ids, now, priority)
        )
    return children
