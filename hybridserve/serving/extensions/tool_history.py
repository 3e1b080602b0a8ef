"""Tool results in a replayed conversation, bound the way the Kimi-K3 renderer binds them.

The renderer binds a tool result to a call of the latest assistant turn with calls, by id; an assistant
turn without calls ends that binding. Clients that replay their whole history may split one result into
several items, or keep a result whose call is no longer in the history. Within each run of consecutive
tool messages this keeps one result message per call (the segments of a split result joined in order,
exactly one newline between them) and replays each result that no call claims as a user note carrying
its output, after the run. Nothing is dropped, and the input messages are not mutated.
"""

from __future__ import annotations

from typing import Any


def join_segments(first: str, second: str) -> str:
    """Two segments of one result: exactly one newline between them; an empty segment adds nothing."""
    if not first or not second:
        return first + second
    return first + second if first.endswith("\n") or second.startswith("\n") else f"{first}\n{second}"


def orphan_note(message: dict[str, Any]) -> dict[str, Any]:
    call_id = message.get("tool_call_id", "")
    text = f"[Tool result for call {call_id}, whose call is not in this conversation]\n{_content(message)}"
    return {"role": "user", "content": text}


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _run(run: list[dict[str, Any]], claimed: set[str]) -> list[dict[str, Any]]:
    kept: dict[str, dict[str, Any]] = {}
    notes: list[dict[str, Any]] = []
    for message in run:
        call_id = message.get("tool_call_id")
        if call_id not in claimed:
            notes.append(orphan_note(message))
        elif call_id in kept:
            kept[call_id]["content"] = join_segments(kept[call_id]["content"], _content(message))
        else:
            kept[call_id] = {**message, "content": _content(message)}
    return [*kept.values(), *notes]


def prepare_tool_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    claimed: set[str] = set()
    run: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            run.append(message)
            continue
        if run:
            out.extend(_run(run, claimed))
            run = []
        if message["role"] == "assistant":
            claimed = {call.get("id", "") for call in message.get("tool_calls") or []}
        out.append(message)
    if run:
        out.extend(_run(run, claimed))
    return out
