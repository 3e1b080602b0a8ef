"""`hybridserve run-batch`: the scripted engine for the command's behaviour (answers equal to the HTTP routes',
error lines, resume after a torn line, refused inputs and outputs, the in-flight bound, an engine that stops),
and one small run of the real default model against its own HTTP endpoints."""

import asyncio
import dataclasses
import json
import logging
import os
import signal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hybridserve.config import EngineConfig, ServingConfig
from hybridserve.serving import cli
from hybridserve.serving.app import build_app
from hybridserve.serving.openai.priority import BATCH_OFFSET
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, QUESTION, error_body, serve_with_engine, without_ids

BODIES = {
    "/v1/chat/completions": {"messages": QUESTION, "max_tokens": 8, "temperature": 0},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    "/v1/responses": {"input": "What is the capital of France?", "max_output_tokens": 8, "temperature": 0},
}
TOO_LONG = {"messages": [{"role": "user", "content": "word " * 80}], "max_tokens": 8}


def line(custom_id: str, url: str = "/v1/chat/completions", body: dict | None = None) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": BODIES[url] if body is None else body}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def results(path: Path) -> dict[str, dict]:
    """The output's lines by custom_id, each custom_id exactly once."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in lines}
    assert len(by_id) == len(lines), [r["custom_id"] for r in lines]
    return by_id


class Engine(FakeEngine):
    """The scripted engine, each request taking `delay` seconds; it counts the most requests in flight at
    once, dies (check_health raises) at the generate() call number `die_at`, and sends this process SIGTERM
    at call number `sigterm_at`."""

    def __init__(
        self, tokenizer, *, delay: float = 0.0, die_at: int | None = None, sigterm_at: int | None = None, **kwargs
    ) -> None:
        super().__init__(tokenizer, [PARIS], **kwargs)
        self.delay = delay
        self.die_at = die_at
        self.sigterm_at = sigterm_at
        self.generate_calls = 0
        self.in_flight = self.peak_in_flight = 0
        self.started = 0

    async def generate(self, prompt_token_ids, params, request_id, priority=0):
        self.generate_calls += 1
        if self.generate_calls == self.die_at:
            self.dead = True
        if self.generate_calls == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.dead:
            raise RuntimeError("engine worker process exited (exit code -9)")
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            async for out in super().generate(prompt_token_ids, params, request_id, priority):
                yield out
        finally:
            self.in_flight -= 1


@pytest.fixture
def run(monkeypatch, tmp_path):
    """`run(engine, *flags, resume=False)`: `hybridserve run-batch -i in.jsonl -o out.jsonl` over `engine`,
    returning its exit status; `engine.started` counts the engines it started."""

    def run(engine: Engine, *flags: str, resume: bool = False) -> int | None:
        def build_engine(config):
            engine.started += 1
            engine.config = config
            return engine

        serve_with_engine(monkeypatch, build_engine)
        files = ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
        return cli.main(["run-batch", *files, *flags, *(["--resume"] if resume else [])])

    return run


def test_every_line_runs_and_answers_what_its_http_route_answers(run, tokenizer, tmp_path):
    inputs = [line("chat", "/v1/chat/completions"), line("completion", "/v1/completions")]
    inputs += [line("response", "/v1/responses"), line("too-long", body=TOO_LONG)]
    inputs += [line("other-model", body={**BODIES["/v1/chat/completions"], "model": "gpt-4o"})]
    write_jsonl(tmp_path / "in.jsonl", inputs)
    engine = Engine(tokenizer, max_model_len=64)
    assert run(engine, "--max-model-len", "64") == 0
    assert engine.config == EngineConfig.of(max_model_len=64, kv_cache_prefault=False)  # tests/conftest.py's
    out = results(tmp_path / "out.jsonl")
    assert sorted(out) == sorted(x["custom_id"] for x in inputs)
    with TestClient(build_app(FakeEngine(tokenizer, [PARIS], max_model_len=64), None)) as client:
        for sent in inputs:
            result = out[sent["custom_id"]]
            direct = client.post(sent["url"], json=sent["body"])
            assert result["id"].startswith("batch_req_") and result["error"] is None
            response = result["response"]
            assert response["status_code"] == direct.status_code
            if direct.status_code == 200:
                assert response["request_id"] == response["body"]["id"]
                assert without_ids(response["body"]) == without_ids(direct.json())
            else:
                assert response["request_id"].startswith("req_") and response["body"] == direct.json()
    assert out["too-long"]["response"]["status_code"] == 400
    assert out["too-long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert out["other-model"]["response"]["body"] == error_body(
        "The model `gpt-4o` does not exist.", param="model", code="model_not_found"
    )
    assert set(engine.priorities.values()) == {BATCH_OFFSET}  # batch work, as the online runner marks it


def test_resume_cuts_a_torn_line_and_runs_only_the_missing_custom_ids(run, tokenizer, tmp_path, caplog):
    write_jsonl(tmp_path / "in.jsonl", [line(f"item-{i}") for i in range(5)])
    first = Engine(tokenizer)
    assert run(first) == 0
    output = tmp_path / "out.jsonl"
    complete = output.read_bytes().splitlines(keepends=True)
    kept = b"".join(complete[:2])
    output.write_bytes(kept + complete[2][:40])  # a run killed while writing its third line
    kept_ids = [json.loads(x)["custom_id"] for x in complete[:2]]
    again = Engine(tokenizer)
    caplog.set_level(logging.INFO, "hybridserve")
    assert run(again, resume=True) == 0
    assert output.read_bytes().startswith(kept)
    assert sorted(results(output)) == [f"item-{i}" for i in range(5)]
    assert len(again.calls) == 3 and again.generate_calls == 3
    assert "cutting a torn last line (40 bytes) off" in caplog.text
    assert f"5 requests in {tmp_path / 'in.jsonl'}, 2 already in {output}, 3 to run" in caplog.text
    assert kept_ids == [json.loads(x)["custom_id"] for x in output.read_bytes().splitlines()[:2]]
    done = Engine(tokenizer)
    assert run(done, resume=True) == 0  # nothing left: the engine does not even start
    assert done.started == 0 and "0 to run" in caplog.text


def test_outputs_resume_cannot_continue_are_refused(run, tokenizer, tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [line("a"), line("b")])
    output = tmp_path / "out.jsonl"
    output.write_text('{"custom_id": "a", "response": {"status_code": 200}}\n')
    with pytest.raises(SystemExit) as exit_info:
        run(Engine(tokenizer))
    assert exit_info.value.code == 2
    assert f"--output-file: {output} already holds results (53 bytes); pass --resume" in capsys.readouterr().err
    write_jsonl(output, ['{"custom_id": "a"}', "not json"])
    assert run(Engine(tokenizer), resume=True) == 1
    assert f"{output} line 2 is not a result line (JSON is malformed" in capsys.readouterr().err
    write_jsonl(output, ['{"custom_id": "a"}', '{"custom_id": "a"}'])
    assert run(Engine(tokenizer), resume=True) == 1
    assert f"{output} line 2: custom_id 'a' is already on line 1" in capsys.readouterr().err
    write_jsonl(output, ['{"custom_id": "zzz"}'])
    engine = Engine(tokenizer)
    assert run(engine, resume=True) == 1
    assert f"{output} holds 1 results whose custom_id is not in" in capsys.readouterr().err
    assert engine.started == 0 and output.read_text() == '{"custom_id": "zzz"}\n'


def test_invalid_lines_are_reported_by_number_and_nothing_runs(run, tokenizer, tmp_path, capsys):
    inputs = [line("ok"), "{not json", line("ok"), {**line("embed"), "url": "/v1/embeddings"}]
    inputs += [line("streamed", body={**BODIES["/v1/chat/completions"], "stream": True})]
    write_jsonl(tmp_path / "in.jsonl", inputs)
    engine = Engine(tokenizer)
    assert run(engine) == 1
    assert capsys.readouterr().err == (
        f"hybridserve run-batch: error: {tmp_path / 'in.jsonl'} has 4 invalid lines; nothing was run:\n"
        "  Line 2 is not valid JSON: Invalid JSON: key must be a string at line 1 column 2.\n"
        "  Line 3: custom_id 'ok' is already used on line 1; custom_ids must be unique within a batch.\n"
        "  Line 4: url '/v1/embeddings' is not an endpoint a batch runs (/v1/chat/completions, /v1/completions, "
        "/v1/responses).\n"
        "  Line 5: body.stream is not supported in a batch.\n"
    )
    assert engine.started == 0 and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-requests-in-flight", "0"], "--max-requests-in-flight: must be at least 1, got 0"),
        (["--progress-interval", "0"], "--progress-interval: must be positive, got 0.0"),
        (["--worker-timeout", "0"], "--worker-timeout: must be positive, got 0.0"),
        (["--block-size", "0"], "--block-size: block_size must be positive, got 0"),
    ],
)
def test_usage_errors_name_the_flag(run, tokenizer, tmp_path, capsys, flags, message):
    write_jsonl(tmp_path / "in.jsonl", [line("a")])
    with pytest.raises(SystemExit) as exit_info:
        run(Engine(tokenizer), *flags)
    assert exit_info.value.code == 2
    assert f"hybridserve run-batch: error: {message}" in capsys.readouterr().err


def test_missing_input_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    assert exit_info.value.code == 2
    assert f"--input-file: {tmp_path / 'nope.jsonl'} is not a file" in capsys.readouterr().err


def test_requests_in_flight_are_bounded_and_progress_is_logged(run, tokenizer, tmp_path, caplog):
    write_jsonl(tmp_path / "in.jsonl", [line(f"item-{i}") for i in range(8)])
    engine = Engine(tokenizer, delay=0.05)
    caplog.set_level(logging.INFO, "hybridserve")
    assert run(engine, "--max-requests-in-flight", "3", "--progress-interval", "0.02") == 0
    assert engine.peak_in_flight == 3 and len(results(tmp_path / "out.jsonl")) == 8
    assert "run-batch: 3/8 requests done (3 completed, 0 failed), " in caplog.text
    assert "run-batch: all 8 requests done (8 completed, 0 failed), 8 run in " in caplog.text


def test_an_engine_that_stops_ends_the_run_and_resume_finishes_it(run, tokenizer, tmp_path, caplog):
    write_jsonl(tmp_path / "in.jsonl", [line(f"item-{i}") for i in range(5)])
    output = tmp_path / "out.jsonl"
    assert run(Engine(tokenizer, die_at=3), "--max-requests-in-flight", "1") == 1
    assert sorted(results(output)) == ["item-0", "item-1"]  # the failed call is not written as a result
    assert (
        "run-batch: the engine stopped serving: engine process exited with code 1; 2/5 requests done, their results "
        f"in {output}. Rerun with --resume to finish." in caplog.text
    )
    assert run(Engine(tokenizer), resume=True) == 0
    out = results(output)
    assert sorted(out) == [f"item-{i}" for i in range(5)]
    assert {r["response"]["status_code"] for r in out.values()} == {200}


def test_sigterm_keeps_the_results_so_far(run, tokenizer, tmp_path, caplog):
    write_jsonl(tmp_path / "in.jsonl", [line(f"item-{i}") for i in range(6)])
    output = tmp_path / "out.jsonl"
    engine = Engine(tokenizer, delay=0.01, sigterm_at=4)
    assert run(engine, "--max-requests-in-flight", "2") == 143
    assert "run-batch: stopped by SIGTERM; " in caplog.text
    kept = results(output)  # whole lines only: the requests in flight were cancelled, not written
    assert 2 <= len(kept) < 6 and engine.in_flight == 0
    assert run(Engine(tokenizer), resume=True) == 0
    assert sorted(results(output)) == [f"item-{i}" for i in range(6)]


def test_every_engine_config_field_has_a_run_batch_flag(monkeypatch):
    monkeypatch.delenv("HYBRIDSERVE_KV_CACHE_PREFAULT", raising=False)  # tests/conftest.py's, for started servers
    parser = cli.build_parser()
    run_batch = parser._subparsers._group_actions[0].choices["run-batch"]
    parts = [type(getattr(EngineConfig(), f.name)) for f in dataclasses.fields(EngineConfig)] + [ServingConfig]
    fields = {f.name: f.default for part in parts for f in dataclasses.fields(part)}
    assert {a.dest: a.default for a in run_batch._actions if a.dest in fields} == fields
    assert all(action.help for action in run_batch._actions)


def test_the_real_model_answers_as_its_http_endpoints_do(tmp_path, smollm2_dir):
    """A few lines through the default model (a worker process), then the same bodies through the HTTP app
    over an engine with the same flags: the bodies are equal but for ids and timestamps."""
    from hybridserve.router.deploy import build_engine

    inputs = [line(custom_id, url) for custom_id, url in zip(("chat", "completion", "response"), BODIES, strict=True)]
    inputs += [line("too-long", body={**TOO_LONG, "temperature": 0})]
    write_jsonl(tmp_path / "in.jsonl", inputs)
    flags = ["--max-model-len", "64", "--kv-cache-memory-bytes", "32MiB", "--no-enable-prefix-caching"]
    files = ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert cli.main(["run-batch", *files, *flags]) == 0
    out = results(tmp_path / "out.jsonl")
    config = EngineConfig.of(max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, enable_prefix_caching=False)
    engine = build_engine(config)
    try:
        with TestClient(build_app(engine, None)) as client:
            direct = {x["custom_id"]: client.post(x["url"], json=x["body"]) for x in inputs}
    finally:
        engine.shutdown()
    for custom_id, answer in direct.items():
        response = out[custom_id]["response"]
        assert response["status_code"] == answer.status_code
        assert without_ids(response["body"]) == without_ids(answer.json())
    assert out["too-long"]["response"]["status_code"] == 400
    assert "Paris" in out["chat"]["response"]["body"]["choices"][0]["message"]["content"]
