"""The openai SDK's typed Responses client and streaming helper against the app (fake engine)."""

import openai
import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from hybridserve.serving.parsers import Parsers
from tests.serving.openai.test_tools import ARGS, CALL, TOOLS, script

TEXT = "The capital of France is Paris."


@pytest.fixture
def sdk(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="sk-none", http_client=client, max_retries=0)


def test_create_retrieve_input_items_delete(sdk):
    response = sdk.responses.create(model="smollm2", input="What is the capital of France?", instructions="Be brief.")
    assert (response.status, response.output_text, response.usage.output_tokens) == ("completed", TEXT, 8)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert sdk.responses.retrieve(response.id) == response
    [item] = sdk.responses.input_items.list(response.id).data
    assert (item.role, item.content[0].text) == ("user", "What is the capital of France?")
    follow = sdk.responses.create(model="smollm2", input="And Spain?", previous_response_id=response.id)
    assert follow.previous_response_id == response.id
    sdk.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.retrieve("abc")
    assert info.value.param == "response_id"


def test_stream_helper_accepts_the_event_stream(sdk):
    with sdk.responses.stream(model="smollm2", input="What is the capital of France?") as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert final.output_text == TEXT and final.status == "completed"
    assert sdk.responses.retrieve(final.id).output_text == TEXT


def test_stream_incomplete(sdk):
    """The SDK's get_final_response() only knows response.completed; an incomplete stream still parses."""
    with sdk.responses.stream(model="smollm2", input="Hi", max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert (final.status, final.incomplete_details.reason, final.output_text) == (
        "incomplete",
        "max_output_tokens",
        "The capital of",
    )


def test_stream_helper_with_reasoning_and_a_function_call(engine, tokenizer):
    """The typed helper accumulates reasoning text and the call's arguments from our events."""
    engine.scripts = [script(tokenizer, "<think>Need data.</think>" + CALL)]
    with TestClient(build_app(engine, None, parsers=Parsers("think", "hermes"))) as client:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-none", http_client=client, max_retries=0)
        with sdk.responses.stream(model="smollm2", input="Weather?", tools=TOOLS) as stream:
            arg_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
            final = stream.get_final_response()
    assert "".join(arg_deltas) == ARGS
    reasoning, call = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need data."
    assert (call.type, call.name, call.arguments, call.status) == ("function_call", "get_weather", ARGS, "completed")
    assert final.usage.output_tokens_details.reasoning_tokens > 0
