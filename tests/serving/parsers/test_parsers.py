"""Reasoning and tool-call parsers: exact pieces, whether the text arrives whole or one character at a time."""

import pytest

from hybridserve.serving.parsers import OutputParser, Parsers, Reasoning, Text, ToolCall
from hybridserve.serving.parsers.base import merged

TEMPLATE_WITH_BOTH = "{{ '<think>' }}{% for t in tools %}<tool_call>{% endfor %}"


def parse(parser: OutputParser, deltas: list[str]) -> list:
    pieces = []
    for delta in deltas:
        pieces.extend(parser.feed(delta))
    pieces.extend(parser.finish())
    return merged(pieces)


def both_ways(make, text: str) -> list:
    """The pieces for `text` fed whole; asserts that feeding it one character at a time gives the same."""
    whole = parse(make(), [text])
    assert parse(make(), list(text)) == whole
    return whole


def make(prompt: str = "", tools: bool = True, reasoning: str | None = "think"):
    return lambda: Parsers(reasoning, "hermes").for_request(prompt, tools)


@pytest.mark.parametrize(
    "text, pieces",
    [
        ("Hello there.", [Text("Hello there.")]),
        ("<think>Let me see.</think>Paris.", [Reasoning("Let me see."), Text("Paris.")]),
        ("<think>unfinished", [Reasoning("unfinished")]),
        ("a < b <thin", [Text("a < b <thin")]),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            [ToolCall("get_weather", '{"city": "Paris"}')],
        ),
        (
            'Checking.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "parameters": {"x": 1}}</tool_call>\n',
            [Text("Checking."), ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')],
        ),
        ("<tool_call>not json</tool_call> ok", [Text("<tool_call>not json</tool_call> ok")]),
        ('<tool_call>{"name": "a", "arguments": {"q": 1}}', [ToolCall("a", '{"q": 1}')]),
        ('<tool_call>{"name": "a", "argu', [Text('<tool_call>{"name": "a", "argu')]),
        ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>', [ToolCall("a", '{"k": 2}')]),
        ("  \n", [Text("  \n")]),
    ],
)
def test_pieces(text, pieces):
    assert both_ways(make(), text) == pieces


def test_reasoning_opened_by_the_prompt():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert both_ways(make(prompt), "Hmm.</think>Yes.") == [Reasoning("Hmm."), Text("Yes.")]
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert both_ways(make(closed), "Yes.") == [Text("Yes.")]


def test_tool_markup_is_text_without_tools():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert both_ways(make(tools=False), text) == [Text(text)]


def test_think_inside_reasoning_is_not_a_tool_call():
    text = '<think><tool_call>{"name": "a", "arguments": {}}</tool_call></think>Done.'
    assert both_ways(make(), text) == [
        Reasoning('<tool_call>{"name": "a", "arguments": {}}</tool_call>'),
        Text("Done."),
    ]


def test_no_partial_marker_is_ever_streamed():
    parser = make()()
    streamed = []
    for ch in "Hi <think>x</think> <tool_call>":
        streamed.extend(p.text for p in parser.feed(ch) if isinstance(p, Text))
    assert "".join(streamed) == "Hi"  # trailing whitespace waits: a call may follow


def test_choose_follows_the_template_and_the_flags():
    assert Parsers.choose(TEMPLATE_WITH_BOTH, True) == Parsers("think", "hermes")
    assert Parsers.choose("{{ messages }}", True) == Parsers(None, None)
    assert Parsers.choose("{{ messages }}", False) == Parsers(None, "hermes")  # we write Hermes for it
    assert Parsers.choose(TEMPLATE_WITH_BOTH, True, "none", "none") == Parsers(None, None)
    assert Parsers.choose(None, True, "qwen3", "hermes") == Parsers("qwen3", "hermes")
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: hermes, qwen"):
        Parsers.choose(None, True, tool="nope")
