"""The Kimi sampling-parameter policy (`ExtensionConfig.kimi_param_policy`: `--kimi-param-policy`, off by default).

One implementation for every request type: it checks only the sampling fields the request's model
declares (a chat request has them all, a Responses request only temperature and top_p). top_p unset or
1.0 is pinned to 0.95; any other top_p, a temperature outside [0, 1], a non-zero penalty or n other than
1 is a 400, raised before any engine work.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from hybridserve.serving.openai.errors import APIError

PINNED_TOP_P = 0.95
PENALTIES = ("presence_penalty", "frequency_penalty")
M = TypeVar("M", bound=BaseModel)


def _reject(param: str, value: object, allowed: str) -> APIError:
    return APIError(
        400, f"Invalid '{param}': {value!r}. This deployment requires {allowed}.", param=param, code="invalid_value"
    )


def enforce_kimi_param_policy(request: M) -> M:
    """`request` with top_p pinned; a 400 for values the policy forbids. The input is not mutated."""
    fields = type(request).model_fields
    values = {name: getattr(request, name) for name in ("top_p", "temperature", "n", *PENALTIES) if name in fields}
    update = {}
    if "top_p" in values:
        top_p = values["top_p"]
        if top_p is None or top_p == 1.0:
            update["top_p"] = PINNED_TOP_P
        elif top_p != PINNED_TOP_P:
            raise _reject("top_p", top_p, f"top_p to be unset, 1.0 or {PINNED_TOP_P}")
    temperature = values.get("temperature")
    if temperature is not None and not 0.0 <= temperature <= 1.0:
        raise _reject("temperature", temperature, "a temperature between 0 and 1")
    for name in PENALTIES:
        if values.get(name) not in (None, 0.0):
            raise _reject(name, values[name], f"{name} to be unset or 0")
    if values.get("n") not in (None, 1):
        raise _reject("n", values["n"], "n to be 1")
    return request.model_copy(update=update)
