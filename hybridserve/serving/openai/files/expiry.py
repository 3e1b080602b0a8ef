"""When a file expires: OpenAI's expiration policy (`{"anchor": "created_at", "seconds": N}`, N from one hour to
30 days), given at upload (`expires_after`, as form fields `expires_after[anchor]` / `expires_after[seconds]`)
or for a batch's output and error files (`output_expires_after`, anchored at those files' creation, when the
batch ends). A file without one never expires."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError

from hybridserve.serving.openai.errors import APIError, validation_error
from hybridserve.serving.openai.protocol import RequestModel

MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600


class ExpiresAfter(RequestModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)


def form_expiry(fields: dict[str, str]) -> ExpiresAfter | None:
    """The upload form's `expires_after[anchor]` and `expires_after[seconds]`, if either is there; a 400
    naming the field and the value otherwise."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    policy: dict[str, str | int] = {} if anchor is None else {"anchor": anchor}
    if seconds is not None:
        try:
            policy["seconds"] = int(seconds)
        except ValueError:
            raise APIError(
                400,
                f"Invalid value for 'expires_after.seconds': expected an integer, got '{seconds}'.",
                param="expires_after.seconds",
                code="invalid_type",
            ) from None
    try:
        return ExpiresAfter.model_validate(policy)
    except ValidationError as exc:
        raise validation_error([{**e, "loc": ("expires_after", *e["loc"])} for e in exc.errors()]) from None
