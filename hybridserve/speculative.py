"""`--speculative-config`: vLLM's JSON keys for lossless speculative decoding, validated with errors naming them."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from hybridserve.sampling_params import InvalidParameter

SPECULATIVE_METHODS = ("ngram", "suffix")
# Keys that only one method reads; naming one under the other method is an error (it would be ignored).
_METHOD_KEYS = {
    "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
    "suffix": (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
}


def _bad(message: str) -> InvalidParameter:
    return InvalidParameter("speculative_config", f"speculative_config {message}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(least, f"an integer of at least {least}")
        raise _bad(f"{name} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decoding request proposes up to `num_speculative_tokens` tokens from its own
    tokens (ngram: prompt lookup; suffix: suffix trees, engine/suffix_drafting.py) and the model verifies them
    in the same step. How many a request may propose in a step depends on the step and on how often its drafts
    were accepted (drafting.py, `draft_lengths`)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix of the request's tokens looked up earlier in them
    prompt_lookup_min: int = 1  # ngram: the shortest, tried last
    # suffix: the trees hold substrings up to this long, which bounds a match plus its draft (and the memory:
    # at most this many nodes per token)
    suffix_decoding_max_tree_depth: int = 24
    # suffix: finished requests whose outputs stay in the cross-request tree (the least recently finished
    # leaves first); 0 turns that tree off
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: a draft is at most this times the match's length
    suffix_decoding_min_token_prob: float = 0.1  # suffix: the draft stops where its estimated probability falls below
    # What reading the weights once costs, in tokens' compute: drafts are sized against it. None: measured at
    # start-up (roofline.py); a large value drafts whatever the batch; 0 prices a step by its tokens alone.
    weight_read_tokens: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise _bad(f"method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            _check_int(name, getattr(self, name), 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _bad(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 2)
        _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0)
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not _is_number(factor) or factor <= 0:
            raise _bad(f"suffix_decoding_max_spec_factor must be a number above 0, got {factor!r}")
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise _bad(f"suffix_decoding_min_token_prob must be a number from 0 to 1, got {prob!r}")
        reads = self.weight_read_tokens
        if reads is not None and (not _is_number(reads) or not reads >= 0):
            raise _bad(f"weight_read_tokens must be a number of at least 0, got {reads!r}")
        defaults = {f.name: f.default for f in fields(self)}
        for method, keys in _METHOD_KEYS.items():
            for key in keys if method != self.method else ():
                if getattr(self, key) != defaults[key]:
                    raise _bad(f"{key} ({getattr(self, key)!r}) applies to method {method!r}, not {self.method!r}")

    @classmethod
    def from_dict(cls, values: object) -> SpeculativeConfig:
        if not isinstance(values, dict):
            raise _bad(f"must be a JSON object, got {values!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise _bad(f"has unknown keys {unknown} (known: {sorted(known)})")
        missing = [name for name in ("method", "num_speculative_tokens") if name not in values]
        if missing:
            raise _bad(f"needs {missing}, got {values!r}")
        return cls(**values)


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """'{"method": "ngram", "num_speculative_tokens": 4}' → SpeculativeConfig."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(f"is not valid JSON ({exc}): {text!r}") from None
    return SpeculativeConfig.from_dict(values)
