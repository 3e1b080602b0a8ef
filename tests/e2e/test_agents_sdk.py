"""openai-agents, unchanged, against our Responses API: an Agent forced to call its one function tool runs to a
final answer, non-streamed and streamed. The scripted engine sits behind the real app on a real socket, so the
test knows every token: turn 1 is the forced call (a JSON list of calls), turn 2 the answer."""

import asyncio
import json

import agents
import httpx
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool
from openai import AsyncOpenAI

from hybridserve.serving.app import build_app
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import serve_in_thread

KEY = "sk-agents"
EOS = 2
FORCED_CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
TOOL_RESULT = '{"temp_c": 21}'
ANSWER = "It is 21 C in Paris."
INSTRUCTIONS = "Answer briefly."


def script(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [EOS]


@pytest.fixture(autouse=True)
def no_tracing():
    agents.set_tracing_disabled(True)  # the SDK would otherwise export traces to api.openai.com


@pytest.fixture
def engine(tokenizer):
    engine = FakeEngine(tokenizer, [], max_model_len=1024)
    engine.turns = [script(tokenizer, FORCED_CALL), script(tokenizer, ANSWER)]
    return engine


@pytest.fixture
def server(engine):
    with serve_in_thread(build_app(engine, KEY)) as url:
        yield url


async def run_agent(url: str, streamed: bool):
    """Runs the agent; returns its result, the request bodies it sent, the tool's calls and the stream events."""
    sent: list[dict] = []
    tool_calls: list[str] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        tool_calls.append(city)
        return TOOL_RESULT

    http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=30)
    client = AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, http_client=http)
    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=OpenAIResponsesModel("smollm2", client),
        model_settings=ModelSettings(tool_choice="required"),
    )
    events = []
    async with http:
        if streamed:
            result = Runner.run_streamed(agent, "Weather in Paris?")
            events = [event async for event in result.stream_events()]
        else:
            result = await Runner.run(agent, "Weather in Paris?")
    return result, sent, tool_calls, events


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agent_forced_tool_call_then_answer(server, engine, tokenizer, streamed):
    result, sent, tool_calls, events = asyncio.run(asyncio.wait_for(run_agent(server, streamed), 60))

    assert result.final_output == ANSWER
    assert tool_calls == ["Paris"]  # the tool ran once, with the arguments of the forced call
    first, second = sent
    assert [body.get("stream", False) for body in sent] == [streamed, streamed]
    assert first["tool_choice"] == "required"
    assert "tool_choice" not in second  # the agent resets tool_choice to auto once a tool was used

    # what the server answered: a function_call item on turn 1, the message on turn 2
    [call] = result.raw_responses[0].output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    [message] = result.raw_responses[1].output
    assert (message.type, message.content[0].text) == ("message", ANSWER)

    # turn 2 sends the whole history back: the call as our server made it, and the tool's output
    assert second["input"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "id": call.id,
            "call_id": call.call_id,
            "name": "get_weather",
            "arguments": call.arguments,
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT},
    ]

    # and the engine saw it rendered: SmolLM2's template knows no tools, so they are written in the Hermes form
    schema = first["tools"][0]["parameters"]
    declaration = json.dumps({"name": "get_weather", "description": "Current weather in a city.", "parameters": schema})
    prompt_1, prompt_2 = (tokenizer.decode(ids) for ids, _, _ in engine.calls)
    assert prompt_1 == (
        f"<|im_start|>system\n{INSTRUCTIONS}\n\n# Tools\n\nYou may call one or more of these functions to help with "
        f"the user's request. Their signatures, one per line:\n<tools>\n{declaration}\n</tools>\n\n"
        "To call a function, write one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt_2 == (
        prompt_1 + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert engine.turns == [] and len(engine.completed) == 2 and engine.aborted == []

    # both responses were stored (the agent leaves store at its default)
    headers = {"Authorization": f"Bearer {KEY}"}
    stored = httpx.get(f"{server}/v1/responses/{result.raw_responses[1].response_id}", headers=headers).json()
    assert stored["output"][0]["content"][0]["text"] == ANSWER

    if streamed:
        raw = [e.data.type for e in events if e.type == "raw_response_event"]
        assert raw.count("response.created") == raw.count("response.completed") == 2
        assert "response.function_call_arguments.done" in raw
        deltas = [e.data.delta for e in events if e.type == "raw_response_event" and e.data.type.endswith("text.delta")]
        assert "".join(deltas) == ANSWER
        items = [e.name for e in events if e.type == "run_item_stream_event"]
        assert items == ["tool_called", "tool_output", "message_output_created"]
