"""schemathesis over the served OpenAPI document: requests generated from it, sent to a real server, never a 5xx.

A real `hybridserve serve` (the embedded SmolLM2-135M) takes every operation's generated requests, valid and
invalid alike; each answer must not be a server error, must have a status and a content type the document
lists. Completion budgets are kept tiny (an integer one above 2 becomes 2, a missing one is 2), so the run is
bounded by the number of cases, not by generation; the document's ranges let most valid cases generate.
"""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance  # noqa: E402
from schemathesis.core.failures import Failure, FailureGroup  # noqa: E402

from tests.e2e.test_e2e_server import KEY, running_server  # noqa: E402

pytestmark = pytest.mark.slow  # a server start-up and a few hundred requests: about 2 minutes on 2 cores

BUDGETS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
TINY = 2
CASES = 12  # per operation and mode (valid requests, invalid ones)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


def served(body: object, model: str) -> None:
    """A generation body for this server: its model where a model name is given (any other is a 404, tested
    elsewhere), a completion budget of at most TINY tokens (a value of the wrong type is left as sent)."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    for key in BUDGETS:
        value = body.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > TINY):
            body[key] = TINY


def test_generated_requests_get_no_server_error(tmp_path):
    """(schemathesis' own pytest plugin does not run under this pytest, so each operation's cases are drawn
    with hypothesis here, derandomized: the same cases every run.)"""
    auth = {"Authorization": f"Bearer {KEY}"}
    failures: list[str] = []
    answered: dict[str, set[int]] = {}  # operation → the statuses it answered
    with running_server(tmp_path / "server.log") as (url, _):
        api = schemathesis.openapi.from_url(f"{url}/openapi.json")
        model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]

        @settings(
            max_examples=CASES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        def send(case) -> None:
            served(case.body, model)
            response = case.call(headers=auth, timeout=60)
            answered.setdefault(case.operation.label, set()).add(response.status_code)
            try:
                case.validate_response(response, checks=CHECKS)
            except (Failure, FailureGroup) as exc:  # each names the request that reproduces it
                failures.append(f"{case.operation.label}: {exc}")

        operations = [result.ok() for result in api.get_all_operations()]
        assert len(operations) > 15
        for operation in operations:
            if operation.path == "/metrics":  # Prometheus text: nothing to generate
                continue
            for mode in GenerationMode:
                try:
                    given(case=operation.as_strategy(generation_mode=mode))(send)()
                except Unsatisfiable:  # an operation that takes no input has no invalid request
                    assert mode is GenerationMode.NEGATIVE, operation.label
    assert not failures, "\n\n".join(failures[:5])
    for label in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses"):
        assert {200, 400} <= answered[label], (label, answered[label])  # generations ran, bad input was refused
