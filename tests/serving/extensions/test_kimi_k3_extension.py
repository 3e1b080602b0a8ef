"""KimiK3ServingExtension's hooks on inline requests: derived kwargs, the sampling policy, tool history.

Example tests pin each rule; hypothesis properties check them over generated conversations and parameters.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.config import ExtensionConfig
from hybridserve.serving.extensions import ServingExtension, extension_for
from hybridserve.serving.extensions.kimi_k3 import EFFORTS, KimiK3ServingExtension
from hybridserve.serving.extensions.tool_history import prepare_tool_history
from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.protocol import ChatCompletionRequest
from hybridserve.serving.openai.responses.protocol import ResponsesRequest

K3 = KimiK3ServingExtension()
K3_POLICY = KimiK3ServingExtension(ExtensionConfig(kimi_param_policy=True))
TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
RANK = {"minimal": 0, "low": 1, "medium": 2, "high": 3, "xhigh": 4, "max": 5}


def responses_kwargs(**fields) -> dict:
    return K3.apply_responses_extensions(ResponsesRequest(input="hi", **fields)).chat_template_kwargs


def chat_kwargs(**fields) -> dict:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    return K3.apply_chat_extensions(request).chat_template_kwargs


def test_extension_is_chosen_by_model_type():
    assert isinstance(extension_for("kimi_k3"), KimiK3ServingExtension)
    assert type(extension_for("llama")) is ServingExtension and type(extension_for(None)) is ServingExtension


def test_extension_gets_the_deployment_config():
    config = ExtensionConfig(kimi_param_policy=True)
    assert extension_for("kimi_k3", config).config is config and extension_for(None, config).config is config
    assert extension_for("kimi_k3").config == ExtensionConfig(kimi_param_policy=False)


@pytest.mark.parametrize(
    ("effort", "expected"),
    [
        ("minimal", {"thinking_effort": "low"}),
        ("low", {"thinking_effort": "low"}),
        ("medium", {"thinking_effort": "high"}),
        ("high", {"thinking_effort": "high"}),
        ("xhigh", {"thinking_effort": "max"}),
        ("max", {"thinking_effort": "max"}),
        ("none", {"thinking": False}),
        (None, {}),
    ],
)
def test_effort_levels_on_both_endpoints(effort, expected):
    assert responses_kwargs(reasoning=None if effort is None else {"effort": effort}) == expected
    assert chat_kwargs(reasoning_effort=effort) == expected


def test_unknown_effort_is_a_400():
    with pytest.raises(APIError) as exc:
        responses_kwargs(reasoning={"effort": "extreme"})
    assert exc.value.status == 400 and exc.value.param == "reasoning.effort"


@pytest.mark.parametrize("choice", ["required", "none"])
def test_tool_choice_only_with_tools(choice):
    assert responses_kwargs(tools=TOOLS, tool_choice=choice) == {"tool_choice": choice}
    assert responses_kwargs(tool_choice=choice) == {}
    assert chat_kwargs(tools=CHAT_TOOLS, tool_choice=choice) == {"tool_choice": choice}
    assert responses_kwargs(tools=TOOLS, tool_choice="auto") == {}


def test_response_formats():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema}
    assert responses_kwargs(text={"format": fmt}) == {"response_format": {"type": "json_schema", "schema": schema}}
    assert responses_kwargs(text={"format": {"type": "json_object"}}) == {"response_format": {"type": "json_object"}}
    assert responses_kwargs(text={"format": {"type": "text"}}) == {}
    nested = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert chat_kwargs(response_format=nested) == {"response_format": {"type": "json_schema", "schema": schema}}


def test_explicit_kwargs_win():
    explicit = {"thinking_effort": "low", "tool_choice": "auto"}
    kwargs = responses_kwargs(
        reasoning={"effort": "max"}, tools=TOOLS, tool_choice="required", chat_template_kwargs=explicit
    )
    assert kwargs == explicit
    assert chat_kwargs(thinking=False, chat_template_kwargs={"thinking": True}) == {"thinking": True}


def test_chat_thinking_field():
    assert chat_kwargs(thinking={"type": "disabled"}) == {"thinking": False}
    assert chat_kwargs(thinking=True, reasoning_effort="medium") == {"thinking": True, "thinking_effort": "high"}


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "retrieval"}], "messages[0].tools[0].type"),
        ([{"type": "function", "function": {"name": "9lives"}}], "messages[0].tools[0].function.name"),
        ([{"type": "function", "function": {"name": "a" * 257}}], "messages[0].tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, "messages[0].tools[1].function.name"),
    ],
)
def test_tools_on_a_system_message_are_validated(tools, param):
    request = ChatCompletionRequest(messages=[{"role": "system", "content": "", "tools": tools}])
    with pytest.raises(APIError) as exc:
        K3.apply_chat_extensions(request)
    assert (exc.value.status, exc.value.param) == (400, param)


# --- the sampling policy -------------------------------------------------------------------------------


def test_policy_is_off_by_default():
    request = K3.apply_responses_extensions(ResponsesRequest(input="hi", temperature=1.5, top_p=0.5))
    assert (request.temperature, request.top_p) == (1.5, 0.5)


@pytest.mark.parametrize("top_p", [None, 1.0, 0.95])
def test_policy_pins_top_p(top_p):
    assert K3_POLICY.apply_responses_extensions(ResponsesRequest(input="hi", top_p=top_p)).top_p == 0.95
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=top_p)
    assert K3_POLICY.apply_chat_extensions(chat).top_p == 0.95


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 0.5),
        ("temperature", 1.5),
        ("temperature", -0.1),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("n", 2),
    ],
)
def test_policy_rejects(field, value):
    with pytest.raises(APIError) as exc:
        K3_POLICY.apply_chat_extensions(
            ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{field: value})
        )
    assert (exc.value.status, exc.value.param) == (400, field)


# --- tool history ----------------------------------------------------------------------------------------


def assistant(*ids: str, content: str = "") -> dict:
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def tool(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def test_split_results_are_joined_and_orphans_become_notes_after_their_run():
    messages = [
        {"role": "user", "content": "go"},
        assistant("a", "b"),
        tool("a", "part 1"),
        tool("zzz", "lost"),
        tool("b", "B"),
        tool("a", "part 2"),
        {"role": "user", "content": "next"},
    ]
    before = copy.deepcopy(messages)
    out = prepare_tool_history(messages)
    assert messages == before  # not mutated
    assert out[:2] == messages[:2]
    assert out[2:5] == [tool("a", "part 1\npart 2"), tool("b", "B"), out[4]]
    assert out[4]["role"] == "user" and out[4]["content"].endswith("]\nlost") and "zzz" in out[4]["content"]
    assert out[5] == {"role": "user", "content": "next"}


def test_an_assistant_turn_without_calls_ends_the_binding():
    out = prepare_tool_history([assistant("a"), tool("a", "1"), assistant(content="done"), tool("a", "late")])
    assert out[:3] == [assistant("a"), tool("a", "1"), assistant(content="done")]
    assert out[3]["role"] == "user" and out[3]["content"].endswith("late")


@pytest.mark.parametrize(
    ("segments", "joined"),
    [(["x", "y"], "x\ny"), (["x\n", "y"], "x\ny"), (["x", "\ny"], "x\ny"), (["x", "", "y"], "x\ny"), (["", "y"], "y")],
)
def test_joining_rules(segments, joined):
    out = prepare_tool_history([assistant("a"), *(tool("a", s) for s in segments)])
    assert out == [assistant("a"), tool("a", joined)]


def test_content_parts_are_read_as_text():
    parts = [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]
    assert prepare_tool_history([assistant("a"), tool("a", parts)])[1]["content"] == "p1\np2"  # type: ignore[arg-type]


# --- properties ----------------------------------------------------------------------------------------

_segment = st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), min_size=1, max_size=6)
_ids = st.sampled_from(["a", "b", "c", "d"])


@st.composite
def histories(draw) -> list[dict]:
    messages: list[dict] = [{"role": "user", "content": "start"}]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["calls", "text", "user"]))
        if kind == "calls":
            messages.append(assistant(*draw(st.lists(_ids, min_size=1, max_size=3, unique=True))))
        elif kind == "text":
            messages.append(assistant(content=draw(_segment)))
        else:
            messages.append({"role": "user", "content": draw(_segment)})
        messages.extend(tool(draw(_ids), draw(_segment)) for _ in range(draw(st.integers(0, 4))))
    return messages


def runs(messages: list[dict]) -> list[tuple[set[str], list[dict], list[dict]]]:
    """Each run of tool messages: the ids its binding claims, its messages, and what follows it up to the next
    non-tool, non-note message (the rewritten run)."""
    out, claimed, i = [], set(), 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "assistant":
            claimed = {c["id"] for c in m.get("tool_calls") or []}
        if m["role"] != "tool":
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        out.append((claimed, messages[i:j]))
        i = j
    return out


@settings(max_examples=200, deadline=None)
@given(histories())
def test_history_properties(messages):
    before = copy.deepcopy(messages)
    out = prepare_tool_history(messages)
    assert messages == before
    assert prepare_tool_history(out) == out  # idempotent
    # no result text lost: each segment appears in a kept result or a note
    texts = [m["content"] for m in out if m["role"] in ("tool", "user")]
    for m in messages:
        if m["role"] == "tool":
            assert any(m["content"] in t for t in texts)
    # the non-tool messages a client sent are all there, in order
    non_tool = [m for m in messages if m["role"] != "tool"]
    assert [m for m in out if m["role"] != "tool" and not _is_note(m)] == non_tool
    kept_runs = runs(out)
    original_runs = runs(messages)
    assert len(kept_runs) <= len(original_runs)
    for claimed, run in kept_runs:
        ids = [m["tool_call_id"] for m in run]
        assert len(ids) == len(set(ids)) and set(ids) <= claimed  # one kept result per call, bound by id
    # within each original run: kept results then that run's notes, segments joined with exactly one newline
    position = 0
    for claimed, run in original_runs:
        start = next(k for k in range(position, len(out)) if out[k]["role"] == "tool" or _is_note(out[k]))
        kept_ids = list(dict.fromkeys(m["tool_call_id"] for m in run if m["tool_call_id"] in claimed))
        orphans = [m for m in run if m["tool_call_id"] not in claimed]
        block = out[start : start + len(kept_ids) + len(orphans)]
        for call_id, kept in zip(kept_ids, block, strict=False):
            assert kept["tool_call_id"] == call_id
            assert kept["content"] == "\n".join(m["content"] for m in run if m["tool_call_id"] == call_id)
        assert all(_is_note(m) for m in block[len(kept_ids) :]) and len(block) == len(kept_ids) + len(orphans)
        position = start + len(block)


def _is_note(message: dict) -> bool:
    return message["role"] == "user" and message["content"].startswith("[Tool result")


_maybe_float = st.none() | st.floats(-1, 2, allow_nan=False) | st.sampled_from([0.95, 1.0, 0.0])


@settings(max_examples=200, deadline=None)
@given(_maybe_float, _maybe_float, st.booleans())
def test_policy_agrees_between_chat_and_responses(temperature, top_p, enabled):
    extension = K3_POLICY if enabled else K3
    results = []
    for make, apply in (
        (
            lambda: ChatCompletionRequest(
                messages=[{"role": "user", "content": "x"}], temperature=temperature, top_p=top_p
            ),
            extension.apply_chat_extensions,
        ),
        (
            lambda: ResponsesRequest(input="x", temperature=temperature, top_p=top_p),
            extension.apply_responses_extensions,
        ),
    ):
        try:
            request = apply(make())
            results.append((request.temperature, request.top_p))
        except APIError as exc:
            results.append(exc.param)
    assert results[0] == results[1]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(EFFORTS)), st.sampled_from([None, "auto", "none", "required"]), st.booleans())
def test_effort_never_lower_and_tool_choice_only_with_tools(effort, choice, with_tools):
    kwargs = responses_kwargs(reasoning={"effort": effort}, tool_choice=choice, tools=TOOLS if with_tools else None)
    assert RANK[kwargs["thinking_effort"]] >= RANK[effort]
    assert ("tool_choice" in kwargs) == (with_tools and choice in ("required", "none"))
