"""The Codex CLI, unchanged, against our Responses API (streamed, store false, the whole history each turn,
tools of several types): two turns of `codex exec` against a real `hybridserve serve` (the embedded
SmolLM2-135M) end without a protocol error, and a tool loop against the scripted engine sends exactly the
items it should.

`make test-slow` installs the pinned CLI into .npm-tools/; without it these tests skip. Against SmolLM2,
Codex's own system prompt and some tool groups are switched off so the prompt (about 1.3k tokens) suits a CPU.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from hybridserve.serving.app import build_app
from hybridserve.serving.parsers import Parsers
from tests.e2e.test_e2e_server import KEY, REPO, running_server
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import serve_in_thread

pytestmark = pytest.mark.slow

CODEX_VERSION = "0.171.0"  # keep in step with CODEX_VERSION in the Makefile
CODEX = Path(os.environ.get("HYBRIDSERVE_CODEX", REPO / ".npm-tools/node_modules/.bin/codex"))
PROTOCOL_ERRORS = (
    "stream closed before response.completed",
    "stream error",
    "unexpected status",
    "error sending request",
    "Reconnecting",
)
# SmolLM2 samples at temperature 1 (Codex sends none) and now and then rambles to the context limit; that
# ends the turn with an incomplete response, which Codex reports as this failure. It is not a protocol error.
RAMBLED = "Incomplete response returned, reason: max_output_tokens"
ATTEMPTS = 3


def write_codex_home(home: Path, url: str, *, slim: bool) -> None:
    """CODEX_HOME/config.toml with our server as the provider; `slim` switches off Codex's long system prompt,
    the environment context (it names the temporary directory), goal tools and bundled skills."""
    codex_home = home / "codex"
    codex_home.mkdir(parents=True)
    config = """model = "smollm2"
model_provider = "hybridserve"
check_for_update_on_startup = false
"""
    if slim:
        instructions = codex_home / "instructions.md"
        instructions.write_text("You are a helpful assistant. Answer in one short sentence.")
        config += f"""model_instructions_file = "{instructions}"
include_environment_context = false

[features]
goals = false

[skills.bundled]
enabled = false
"""
    config += f"""
[model_providers.hybridserve]
name = "hybridserve"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "HYBRIDSERVE_TEST_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false
"""
    (codex_home / "config.toml").write_text(config)


def run_codex(home: Path, work: Path, *args: str) -> tuple[int, str, list[dict]]:
    """One `codex exec --json` run: exit code, everything it printed, and its JSONL events."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CODEX_HOME": str(home / "codex"),
        "HYBRIDSERVE_TEST_KEY": KEY,
    }
    cmd = [str(CODEX), "exec", "--json", "--color", "never", "--strict-config", "--skip-git-repo-check"]
    cmd += ["--sandbox", "read-only", *args]
    proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, proc.stdout + proc.stderr, events


def turn_completed(rc: int, output: str, events: list[dict]) -> dict | None:
    """The usage of a completed turn, or None if the model rambled; fails on a protocol error or any other failure."""
    for marker in PROTOCOL_ERRORS:
        assert marker not in output, f"codex reported {marker!r}:\n{output[-4000:]}"
    types = [event["type"] for event in events]
    if rc == 0:
        assert types[-1] == "turn.completed", output[-4000:]
        assert events[-1]["usage"]["input_tokens"] > 0 and events[-1]["usage"]["output_tokens"] > 0
        items = [e["item"] for e in events if e["type"] == "item.completed"]
        messages = [item for item in items if item["type"] == "agent_message"]
        assert messages and messages[-1]["text"], output[-4000:]
        return events[-1]["usage"]
    assert types[-1] == "turn.failed" and RAMBLED in events[-1]["error"]["message"], output[-4000:]
    return None


@pytest.fixture(scope="module")
def codex_binary():
    if not CODEX.exists():
        pytest.skip(f"no Codex CLI at {CODEX} (`make test-slow` installs @openai/codex@{CODEX_VERSION})")
    version = subprocess.run([str(CODEX), "--version"], capture_output=True, text=True, timeout=60).stdout
    assert version.split()[-1] == CODEX_VERSION, f"{CODEX} is {version!r}; the test is written for {CODEX_VERSION}"
    return CODEX


def test_codex_exec_two_turns(codex_binary, tmp_path):
    log = tmp_path / "server.log"
    runs = 0
    with running_server(log) as (url, _):
        for attempt in range(ATTEMPTS):
            home, work = tmp_path / f"home{attempt}", tmp_path / f"work{attempt}"
            work.mkdir()
            write_codex_home(home, url, slim=True)
            runs += 1
            first = turn_completed(*run_codex(home, work, "Say hello."))
            if first is None:
                continue
            # the second turn resumes the session: Codex sends the first turn back as input items (store is
            # false), and they render to the first prompt again, so its KV blocks (16 tokens each) are reused
            runs += 1
            second = turn_completed(*run_codex(home, work, "resume", "--last", "Now say goodbye."))
            if second is not None:
                assert second["input_tokens"] > first["input_tokens"]
                assert second["cached_input_tokens"] >= first["input_tokens"] - 16, (first, second)
                break
        else:
            pytest.fail(f"SmolLM2 ran to the context limit in all {ATTEMPTS} attempts; see {log}")
    text = log.read_text()
    posts = re.findall(r'"POST /v1/responses HTTP/1\.1" (\d+)', text)
    assert set(posts) == {"200"} and len(posts) >= runs, posts  # more if the model called a tool


# The same CLI with its default prompt and tools against the scripted engine behind the real app: a tool loop
# whose every token is known. Turn 1 reasons and calls exec_command; Codex runs it and sends the whole history
# back (reasoning, call and output items); turn 2 answers.
CALL = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo hi"}}\n</tool_call>'
TURNS = ["<think>I should run a command.</think>" + CALL, "<think>It printed hi.</think>Done: hi."]


def recording(app, bodies: list[dict]):
    """`app`, keeping every POST /v1/responses body in `bodies`."""

    async def recorded(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/responses":
            return await app(scope, receive, send)
        chunks: list[bytes] = []

        async def receive_and_keep():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message["body"])
                if not message.get("more_body"):
                    bodies.append(json.loads(b"".join(chunks)))
            return message

        await app(scope, receive_and_keep, send)

    return recorded


def test_codex_tool_loop_against_the_scripted_engine(codex_binary, tokenizer, tmp_path):
    engine = FakeEngine(tokenizer, [], max_model_len=32768)
    engine.turns = [tokenizer.encode(t, add_special_tokens=False) + [2] for t in TURNS]
    bodies: list[dict] = []
    app = recording(build_app(engine, KEY, parsers=Parsers("think", "hermes")), bodies)
    work = tmp_path / "work"
    work.mkdir()
    with serve_in_thread(app) as url:
        write_codex_home(tmp_path / "home", url, slim=False)
        rc, output, events = run_codex(tmp_path / "home", work, "Say hi with a shell command.")

    usage = turn_completed(rc, output, events)
    assert usage is not None, output[-4000:]
    items = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] != "error"]
    command, message = items  # (the "error" items are Codex's warning that it knows no metadata for smollm2)
    # (whether the command itself succeeds depends on Codex's sandbox on this host, not on our server)
    assert command["type"] == "command_execution" and "echo hi" in command["command"]
    assert message["type"] == "agent_message"
    assert message["text"] == "Done: hi."
    prompts = [ids for ids, _, _ in engine.calls]
    assert usage["input_tokens"] == sum(map(len, prompts)) and usage["reasoning_output_tokens"] > 0

    first, second = bodies
    for body in bodies:
        assert (body["stream"], body["store"], body["tool_choice"]) == (True, False, "auto")
    assert {tool["type"] for tool in first["tools"]} >= {"function", "namespace", "web_search"}
    assert second["input"][: len(first["input"])] == first["input"]  # the whole history, sent again
    reasoning, call, result = second["input"][len(first["input"]) :]
    assert (reasoning["type"], reasoning["content"]) == (
        "reasoning",
        [{"type": "reasoning_text", "text": "I should run a command."}],
    )
    assert reasoning["id"].startswith("rs_") and reasoning.get("encrypted_content") is None
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call",
        "exec_command",
        {"cmd": "echo hi"},
    )
    assert (result["type"], result["call_id"]) == ("function_call_output", call["call_id"])

    # the history renders as the first prompt, then the call and its output in the Hermes form (no reasoning)
    prompt_1, prompt_2 = (tokenizer.decode(ids) for ids in prompts)
    assert prompt_2 == (
        f"{prompt_1}{CALL}<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{result['output']}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
