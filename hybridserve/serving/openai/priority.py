"""A generation request's scheduling priority: what a client may ask for, and the value the engine gets.

The scheduler serves lower values first and preempts the highest first. Clients may set vLLM's `priority` field
(an integer in [-PRIORITY_LIMIT, PRIORITY_LIMIT]; unset is 0) on Chat Completions, Completions, Responses and
Messages; it is honoured only by a server started with `--scheduling-policy priority`. Under `fcfs` (the default)
a non-zero priority is a 400, as vLLM answers it, rather than a promise the server silently breaks.

Bands: an online request's engine priority is its own; a batch line's (the Batch API, `run-batch`) is its own
plus BATCH_OFFSET, which puts every batch request in the engine's batch band (step_budget.BACKGROUND_PRIORITY up):
less urgent than every online one whatever either asks for, and held to --batch-step-tokens of a step while online
work runs; batch lines keep their order among themselves. Among online requests priority orders admission and
preemption only, as vLLM's does. The server marks its batch calls in their scope
(`batch_state`); nothing a client sends can.
"""

from __future__ import annotations

from starlette.requests import Request

from hybridserve.engine.step_budget import BACKGROUND_PRIORITY
from hybridserve.serving.openai.errors import APIError

FCFS, PRIORITY = "fcfs", "priority"  # --scheduling-policy (config.SCHEDULING_POLICIES)
PRIORITY_LIMIT = BACKGROUND_PRIORITY - 1  # every online value is below the engine's batch band
ONLINE_PRIORITY = 0  # an online request that sets none
# added to a batch line's priority: its most urgent value, -PRIORITY_LIMIT + BATCH_OFFSET, is the band's first
BATCH_OFFSET = BACKGROUND_PRIORITY + PRIORITY_LIMIT


def batch_state() -> dict[str, int]:
    """The scope state of a call the server makes for a batch line."""
    return {"priority_offset": BATCH_OFFSET}


def engine_priority(request: Request, priority: int | None, policy: str) -> int:
    """The engine's priority for a call asking for `priority` (None: unset) under `policy`; a 400 naming the field
    for a value out of range, or for any non-zero one under fcfs."""
    asked = priority or 0
    if not -PRIORITY_LIMIT <= asked <= PRIORITY_LIMIT:
        raise APIError(
            400,
            f"priority must be in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {asked}.",
            param="priority",
            code="invalid_value",
        )
    if asked and policy != PRIORITY:
        raise APIError(
            400,
            f"priority {asked} is only honoured by a server started with --scheduling-policy priority; this one "
            "schedules first come, first served (--scheduling-policy fcfs). Leave priority unset or 0.",
            param="priority",
            code="invalid_value",
        )
    return getattr(request.state, "priority_offset", ONLINE_PRIORITY) + asked
