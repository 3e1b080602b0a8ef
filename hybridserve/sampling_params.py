"""Per-request sampling parameters: one frozen, validated value shared by the frontend and the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

# Numbers below this are treated as zero temperature (greedy), as vLLM does.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's limit: each choice is a sequence the engine runs
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; above it sampling is noise


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain a request's output to a language; set exactly one of the five kinds.

    - json_schema: JSON Schema as JSON text; the output is one JSON value valid against it.
    - json_object: True for any JSON object.
    - regex: the whole output matches this regular expression.
    - grammar: an EBNF grammar (xgrammar's GBNF dialect) whose start rule is `root`.
    - structural_tag: xgrammar's structural tag as JSON text (e.g. free text, then tool calls whose
      arguments follow a schema).
    flexible_whitespace (JSON kinds only): False writes JSON in one compact layout (", " and ": ", no
    newlines), which keeps a model from looping on whitespace; True allows any whitespace JSON allows.

    Only the shape is checked here; `hybridserve.engine.structured_output.check` parses the schema or
    grammar itself (the frontend calls it before a request reaches an engine).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    flexible_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = self.kinds
        _check(len(kinds) == 1, "structured_output", kinds, "must set exactly one of " + ", ".join(STRUCTURED_KINDS))
        if self.flexible_whitespace:
            _check(
                kinds[0] in ("json_schema", "json_object"),
                "structured_output.flexible_whitespace",
                kinds[0],
                "applies only to json_schema and json_object",
            )

    @property
    def kinds(self) -> list[str]:
        """The kinds that are set (exactly one in a valid value)."""
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds[0]


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: off; k >= 0: sampled token plus k alternatives
    # None: off; k >= 0: each prompt token's logprob (but the first's) plus k alternatives, with the first output
    prompt_logprobs: int | None = None
    max_tokens: int | None = None  # None: up to the context limit; 0: the prompt only (e.g. its logprobs)
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # None: unconstrained

    def __post_init__(self) -> None:
        _check(1 <= self.n <= MAX_N, "n", self.n, f"must be in [1, {MAX_N}]")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**63, "seed", self.seed, "must fit in a signed 64-bit integer")
        _check(
            0.0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            self.temperature,
            f"must be in [0, {MAX_TEMPERATURE:g}]",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "must be -1 (disabled) or non-negative")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check(
            0.0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            self.repetition_penalty,
            "must be positive and finite",
        )
        for token_id, bias in self.logit_bias.items():
            _check(-100.0 <= bias <= 100.0, "logit_bias", bias, f"(token {token_id}) must be in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(0 <= value <= MAX_LOGPROBS, name, value, f"must be in [0, {MAX_LOGPROBS}]")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 0, "max_tokens", self.max_tokens, "must be non-negative")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be non-negative")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"must not exceed max_tokens ({self.max_tokens})",
            )
        for s in self.stop:
            _check(len(s) > 0, "stop", s, "must not contain empty strings")
        if self.structured_output is not None:
            # A finished grammar leaves only EOS, which min_tokens would forbid: nothing could be sampled.
            _check(self.min_tokens == 0, "min_tokens", self.min_tokens, "must be 0 with structured_output")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request samples with where it leaves these fields out: OpenAI's neutral values, or those the
    model recommends (its generation_config.json, which AsyncLLM reads). Checked as SamplingParams checks them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            integer = f.name == "top_k"
            ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
            _check(ok, f.name, value, "must be an integer" if integer else "must be a number")
        SamplingParams(**self.changed())

    def changed(self) -> dict[str, float | int]:
        """The fields that differ from OpenAI's neutral values."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


class InvalidParameter(ValueError):
    """A request parameter outside its allowed range; `param` names it for the API error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise InvalidParameter(name, f"{name} {rule}, got {value!r}")
