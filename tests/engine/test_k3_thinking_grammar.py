"""A K3 response format with thinking on: the think channel is free, the response channel holds the JSON.

The grammar spells K3's markers, which the K3 tokenizer has as single added special tokens; these tests
pin that xgrammar matches them by their text (a matcher over the tiny K3 tokenizer) and that the engine
decodes through the whole structure (kimi-k3-tiny, random weights)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from hybridserve.engine.llm import LLM
from hybridserve.engine.structured_output import _grammar, behind_free_text
from hybridserve.rendering.kimi_k3 import (
    END,
    MESSAGE_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    TOOLS_OPEN,
)
from hybridserve.sampling_params import SamplingParams, StructuredOutput
from hybridserve.serving.extensions.kimi_k3 import KimiK3ServingExtension
from hybridserve.serving.parsers.base import Reasoning, Text
from hybridserve.serving.parsers.kimi import KimiK3ReasoningParser
from hybridserve.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
}
SPEC = StructuredOutput(json_schema=json.dumps(SCHEMA))


def _k3(spec: StructuredOutput, thinking: bool | None = True) -> StructuredOutput | None:
    return KimiK3ServingExtension().structured_output(spec, {} if thinking is None else {"thinking": thinking})


@pytest.fixture(scope="module")
def tokenizer(kimi_k3_dir):
    return load_tokenizer(kimi_k3_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))


def _accepts(tokenizer, compiler, spec: StructuredOutput, text: str) -> bool:
    """The tokens of `text`, then the stop token, all accepted, ending the grammar."""
    stop = tokenizer.convert_tokens_to_ids(END)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(_grammar(spec)), override_stop_tokens=[stop])
    ids = tokenizer.encode(text, add_special_tokens=False) + [stop]
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()


def test_markers_are_single_special_tokens(tokenizer):
    ids = tokenizer.encode(THINK_CLOSE + RESPONSE_OPEN, add_special_tokens=False)
    assert len(ids) == 4 + len("think") + len("response")  # <|close|>, <|sep|>, <|open|>, <|sep|>: one each


def test_thinking_off_keeps_the_plain_grammar_and_no_format_stays_none():
    assert _k3(SPEC, thinking=False) == SPEC
    assert _k3(None) is None


@pytest.mark.parametrize("thinking", [True, None])  # None: the template's default, thinking on
def test_thinking_on_defers_the_grammar_to_the_response_channel(tokenizer, compiler, thinking):
    spec = _k3(SPEC, thinking)
    assert spec is not None and spec.kind == "structural_tag"
    answer = '{"ok": true, "color": "red"}'
    good = f"Let me think <about> it.{THINK_CLOSE}{RESPONSE_OPEN}{answer}{RESPONSE_CLOSE}{MESSAGE_CLOSE}"
    assert _accepts(tokenizer, compiler, spec, good)
    assert _accepts(tokenizer, compiler, spec, good.replace("Let me think <about> it.", ""))  # empty think
    bad = {
        "not JSON": good.replace(answer, "hello"),
        "schema violated": good.replace('"red"', '"blue"'),
        "not compact (flexible_whitespace is off)": good.replace(answer, '{"ok":true,"color":"red"}'),
        "response not closed": good.replace(RESPONSE_CLOSE, ""),
        "tools instead of the response": good.replace(RESPONSE_OPEN, TOOLS_OPEN),
        "message closed in the think channel": f"x{MESSAGE_CLOSE}{THINK_CLOSE}{RESPONSE_OPEN}{answer}",
        "ends while thinking": "Still thinking",
    }
    for why, text in bad.items():
        assert not _accepts(tokenizer, compiler, spec, text), why


def test_json_object_and_flexible_whitespace(tokenizer, compiler):
    spec = _k3(StructuredOutput(json_object=True, flexible_whitespace=True))
    assert spec is not None
    text = f"hm{THINK_CLOSE}{RESPONSE_OPEN}" + '{ "a" :1 }' + f"{RESPONSE_CLOSE}{MESSAGE_CLOSE}"
    assert _accepts(tokenizer, compiler, spec, text)
    assert not _accepts(tokenizer, compiler, spec, text.replace('{ "a" :1 }', "[1]"))


@pytest.mark.slow  # ~50 s on 2 cores: random weights spell the markers out byte by byte
def test_engine_output_parses_into_schema_valid_content(kimi_k3_dir):
    """Random weights never spell the closing marker themselves, so the think text is capped (the same
    structure as the extension's, plus a budget); the engine must then force the markers, decode the
    JSON and stop, and the K3 reasoning parser must split that into reasoning and valid content. The grammar
    is over text, so it also allows a marker spelled in byte tokens, which random weights pick (~100 decode
    steps here, ~0.5 s each on 2 CPU cores): the budget allows for that, a small schema keeps it short."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = behind_free_text(
        StructuredOutput(json_schema=json.dumps(schema)),
        opening=THINK_CLOSE + RESPONSE_OPEN,
        closing=RESPONSE_CLOSE + MESSAGE_CLOSE,
        excludes=(THINK_CLOSE, MESSAGE_CLOSE),
        free_max_tokens=6,
    )
    llm = LLM(str(kimi_k3_dir), dtype="float32", device="cpu", enable_prefix_caching=False, kv_cache_prefault=False)
    prompt_text = f'<|open|>message role="user"<|sep|>Answer in JSON.{MESSAGE_CLOSE}{END}'
    prompt_text += f'<|open|>message role="assistant"<|sep|>{THINK_OPEN}'
    prompt = llm.tokenizer.encode(prompt_text, add_special_tokens=False)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=160, structured_output=spec, skip_special_tokens=False)
    choice = llm.generate([prompt], params)[0].outputs[0]
    assert choice.finish_reason == "stop", choice.text
    assert choice.text.endswith(RESPONSE_CLOSE + MESSAGE_CLOSE)  # the stop token itself is not in the text
    parser = KimiK3ReasoningParser(prompt_text)
    pieces = parser.feed(choice.text) + parser.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Text))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    jsonschema.validate(json.loads(content), schema)
    assert reasoning and THINK_CLOSE not in reasoning and RESPONSE_OPEN not in content
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0.0
