"""Grammar-constrained decoding with xgrammar.

- `check` (frontend): parse a StructuredOutput's schema or grammar, raising InvalidParameter naming it.
- `behind_free_text` (frontend): a spec that applies only after free text and an opening marker.
- `GrammarCompiler` (engine): compiles specs on background threads, one cached future per spec, so a
  compile never stalls the busy loop; the tokenizer is loaded (on that thread) only when the first
  constrained request arrives.
- `SequenceGrammar` (engine): one matcher per sequence, advanced with every accepted token.
- `GrammarBitmask` (engine): the step's allowed-token bitmask, filled for the constrained rows only.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar as xgr

from hybridserve.sampling_params import InvalidParameter, StructuredOutput
from hybridserve.tokenizer import load_tokenizer

_CACHE_ENTRIES = 256
_COMPILE_THREADS = 2
# xgrammar prefixes its errors with a timestamp, a C++ source location and sometimes a failed check.
_NATIVE_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
_MAX_ERROR_CHARS = 500


@functools.lru_cache(maxsize=_CACHE_ENTRIES)  # a batch of prompts shares one spec; failures are not cached
def check(spec: StructuredOutput) -> None:
    """Parse the spec's schema or grammar; raise InvalidParameter("structured_output.<kind>", why)."""
    _grammar(spec)


def _grammar(spec: StructuredOutput) -> xgr.Grammar:
    kind = spec.kind
    param = f"structured_output.{kind}"
    try:
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=spec.flexible_whitespace)
        if kind == "json_schema":
            schema = _json(spec.json_schema, param)
            if not isinstance(schema, dict):
                raise InvalidParameter(param, f"{param} must be a JSON object, got {type(schema).__name__}")
            return xgr.Grammar.from_json_schema(spec.json_schema or "", any_whitespace=spec.flexible_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex or "")
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar or "")
        _json(spec.structural_tag, param)
        return xgr.Grammar.from_structural_tag(spec.structural_tag or "")
    except InvalidParameter:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError and its own types for bad input
        raise InvalidParameter(param, f"{param} is invalid: {_clean(exc)}") from exc


def behind_free_text(
    spec: StructuredOutput,
    *,
    opening: str,
    closing: str,
    excludes: Sequence[str] = (),
    free_max_tokens: int | None = None,
) -> StructuredOutput:
    """`spec` deferred: free text (containing neither `opening` nor any of `excludes`), then `opening`,
    then `spec`'s language, then `closing`; the stop token follows as usual. One structural tag, so the
    engine compiles it like any other spec. Marker strings match the tokens that spell them, added special
    tokens included (xgrammar matches a token by its text unless the token decodes to nothing). `spec`
    must already be checked: its language is embedded as the EBNF xgrammar derives from it, so JSON keeps
    its whitespace mode (the structural tag's own json_schema format has no compact layout).
    `free_max_tokens` caps the free text (then `opening` is forced); None leaves it unbounded."""
    grammar = str(_grammar(spec))
    free: dict[str, object] = {"type": "any_text", "excludes": [opening, *excludes]}
    if free_max_tokens is not None:
        free["max_tokens"] = free_max_tokens
    elements = [free, _const(opening), {"type": "grammar", "grammar": grammar}, _const(closing)]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
    return StructuredOutput(structural_tag=json.dumps(tag))


def _const(value: str) -> dict[str, object]:
    return {"type": "const_string", "value": value}


def _json(text: str | None, param: str) -> object:
    try:
        return json.loads(text or "")
    except json.JSONDecodeError as exc:
        raise InvalidParameter(param, f"{param} is not valid JSON: {exc}") from exc


def _clean(exc: Exception) -> str:
    text = _NATIVE_NOISE.sub("", str(exc)).strip()
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


class GrammarCompiler:
    """Compiles specs off the busy loop. `submit` returns a future shared by every request with the same
    spec (n > 1 choices, repeated schemas); the most recent _CACHE_ENTRIES specs stay compiled."""

    def __init__(self, hf_dir: Path, vocab_size: int) -> None:
        self.hf_dir = hf_dir
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's vocabulary
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._compiler: Future[xgr.GrammarCompiler] | None = None
        self._cache: OrderedDict[StructuredOutput, Future[xgr.CompiledGrammar]] = OrderedDict()

    def submit(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            return future
        if self._compiler is None:  # first use: queued ahead of every compile, which waits for it
            self._compiler = self._pool.submit(self._build_compiler)
        compiler = self._compiler
        future = self._pool.submit(lambda: compiler.result().compile_grammar(_grammar(spec)))
        self._cache[spec] = future
        if len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return future

    def _build_compiler(self) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(self.hf_dir), vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info)


class SequenceGrammar:
    """The grammar state of one sequence. It lives on the Request, so preemption (which recomputes KV,
    never re-samples) leaves it as is: tokens already accepted stay accepted."""

    def __init__(self, compiled: xgr.CompiledGrammar, eos_token_ids: list[int]) -> None:
        # The grammar's end is the model's EOS (even with ignore_eos, which cannot outlast the grammar).
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=eos_token_ids or None)

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()


@dataclass(frozen=True)
class TokenMask:
    """Allowed tokens for some rows of a step's logits: bit j of bitmask row i set means token j is allowed."""

    bitmask: torch.Tensor  # int32 [B, ceil(V / 32)], on the logits' device
    rows: list[int]  # the constrained rows; the others' bitmask rows are stale and never read

    def apply(self, logits: torch.Tensor) -> None:
        """In place on [B, V] logits: forbidden tokens of the listed rows become -inf."""
        xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=logits.shape[1], indices=self.rows)


class GrammarBitmask:
    """A reused CPU bitmask with a row per sampled request; only the constrained rows are filled (by
    xgrammar's threads), then the mask moves to the logits' device."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._cpu = xgr.allocate_token_bitmask(1, vocab_size)
        self._filler = xgr.BatchGrammarMatcher()

    def fill(self, rows: Sequence[tuple[int, SequenceGrammar]], batch_size: int, device: torch.device) -> TokenMask:
        if self._cpu.shape[0] < batch_size:
            self._cpu = xgr.allocate_token_bitmask(batch_size, self.vocab_size)
        indices = [row for row, _ in rows]
        self._filler.batch_fill_next_token_bitmask([g.matcher for _, g in rows], self._cpu, indices)
        bitmask = self._cpu[:batch_size]
        return TokenMask(bitmask if device.type == "cpu" else bitmask.to(device), indices)
