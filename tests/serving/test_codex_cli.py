"""The Codex CLI, unchanged, against a real `hybridserve serve` (the embedded SmolLM2-135M): two turns of
`codex exec` through the Responses API (streamed, store false, the whole history each turn, tools of several
types) end without a protocol error.

`make test-slow` installs the pinned CLI into .npm-tools/; without it the test skips. Codex's own system
prompt and several tool groups are switched off so the prompt (about 1.3k tokens) fits SmolLM2 on a CPU.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from .test_e2e_server import KEY, REPO, running_server

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


def codex_config(url: str, instructions: Path) -> str:
    return f"""model = "smollm2"
model_provider = "hybridserve"
model_instructions_file = "{instructions}"
include_environment_context = false
check_for_update_on_startup = false

[model_providers.hybridserve]
name = "hybridserve"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "HYBRIDSERVE_TEST_KEY"
request_max_retries = 0
stream_max_retries = 0

[features]
goals = false

[skills.bundled]
enabled = false

[analytics]
enabled = false
"""


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
        messages = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
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
            (home / "codex").mkdir(parents=True)
            work.mkdir()
            instructions = home / "codex/instructions.md"
            instructions.write_text("You are a helpful assistant. Answer in one short sentence.")
            (home / "codex/config.toml").write_text(codex_config(url, instructions))
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
