"""The anthropic SDK (pinned) unchanged against the app behind a real uvicorn socket; the scripted engine stands
in for the model."""

import anthropic
import pytest

from tests.serving.anthropic.helpers import CALL, MODEL, QUESTION, TOOLS, script
from tests.serving.helpers import serve_in_thread

TEXT = "The capital of France is Paris."


@pytest.fixture
def sdk(app):
    with serve_in_thread(app) as url:
        yield anthropic.Anthropic(base_url=url, api_key="sk-none", max_retries=0)


def test_create(sdk):
    message = sdk.messages.create(model=MODEL, max_tokens=64, messages=QUESTION, system="Be brief.")
    assert message.role == "assistant" and message.type == "message"
    assert [(b.type, b.text) for b in message.content] == [("text", TEXT)]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.output_tokens, message.usage.cache_read_input_tokens) == (8, 0)


def test_stream_text_and_final_message(sdk):
    with sdk.messages.stream(model=MODEL, max_tokens=64, messages=QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == TEXT
    assert [(b.type, b.text) for b in final.content] == [("text", TEXT)]
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", 8)


def test_stream_with_stop_sequence(sdk):
    with sdk.messages.stream(model=MODEL, max_tokens=64, messages=QUESTION, stop_sequences=["Paris"]) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (
        "The capital of France is ",
        "stop_sequence",
        "Paris",
    )


def test_two_turn_tool_loop(sdk, engine, tokenizer):
    """Turn one thinks and calls the tool (streamed); the client runs it and sends the whole turn back, thinking
    block and signature included; turn two answers."""
    engine.turns = [
        script(tokenizer, "<think>Need the weather.</think>" + CALL),
        script(tokenizer, "It is sunny in Paris."),
    ]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    thinking = {"type": "enabled", "budget_tokens": 2048}
    with sdk.messages.stream(model=MODEL, max_tokens=200, messages=question, tools=TOOLS, thinking=thinking) as stream:
        first = stream.get_final_message()
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    call = first.content[1]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}
    history = [*question, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = sdk.messages.create(model=MODEL, max_tokens=200, messages=history, tools=TOOLS, thinking=thinking)
    assert [(b.type, b.text) for b in second.content] == [("text", "It is sunny in Paris.")]
    assert second.stop_reason == "end_turn"
    prompt = tokenizer.decode(engine.calls[1][0])
    assert "Sunny, 24 C" in prompt and "get_weather" in prompt


def test_count_tokens(sdk, engine):
    counted = sdk.messages.count_tokens(model=MODEL, messages=QUESTION, tools=TOOLS)
    sdk.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, tools=TOOLS)
    assert counted.input_tokens == len(engine.calls[0][0])


def test_errors_are_typed_exceptions(sdk):
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk.messages.create(model=MODEL, max_tokens=64, messages=[])
    assert info.value.status_code == 400
    assert info.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "messages: at least one message is required."},
    }
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=QUESTION)


def test_a_wrong_key_is_an_authentication_error(engine):
    from hybridserve.serving.app import build_app

    with serve_in_thread(build_app(engine, "sk-test")) as url:
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=8, messages=QUESTION
            )
        message = anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=QUESTION
        )
    assert message.stop_reason == "end_turn"


def test_a_mid_stream_failure_raises(sdk, engine):
    engine.error_at_step = 2
    stream = sdk.messages.stream(model=MODEL, max_tokens=64, messages=QUESTION)
    with pytest.raises(anthropic.APIStatusError, match="CUDA error"), stream as events:
        list(events.text_stream)
