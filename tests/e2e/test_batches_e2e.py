"""A real `hybridserve serve` killed with SIGKILL mid-batch: the restarted server resumes the batch, and the
output file has every request exactly once."""

import json
import signal
import time

import openai
import psutil
import pytest

from tests.e2e.test_e2e_server import KEY, QUESTION, running_server

NUM_REQUESTS = 8


def poll(client: openai.OpenAI, batch_id: str, done, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not done(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


@pytest.mark.slow  # two server start-ups and sixteen real generations: about 1-2 minutes on 2 cores
def test_kill_9_mid_batch_then_resume(tmp_path):
    body = {"messages": QUESTION, "max_tokens": 24, "temperature": 0}
    data = "".join(
        json.dumps({"custom_id": f"run-7-item-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        + "\n"
        for i in range(NUM_REQUESTS)
    )
    with running_server(tmp_path / "first.log", "--batch-max-requests-in-flight", "1") as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        uploaded = client.files.create(file=("in.jsonl", data.encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        partial = poll(client, batch.id, lambda b: b.request_counts.completed >= 2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert partial.status == "in_progress" and partial.request_counts.completed < NUM_REQUESTS
    with running_server(tmp_path / "second.log") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        done = poll(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
            "completed",
            NUM_REQUESTS,
            0,
        )
        lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"run-7-item-{i}" for i in range(NUM_REQUESTS)]
    texts = {line["response"]["body"]["choices"][0]["message"]["content"] for line in lines}
    assert len(texts) == 1 and "Paris" in texts.pop()  # greedy: the resumed requests answer as the first did
    assert f"batch {batch.id}: resuming (in_progress" in (tmp_path / "second.log").read_text()


@pytest.mark.slow  # one server start-up, a worker restart and eight real generations: about a minute on 2 cores
def test_a_killed_engine_worker_leaves_no_error_lines(tmp_path):
    """The engine worker is killed mid-batch: the requests it was running are not written as errors, the
    batch waits for the restarted worker and ends with every request answered once."""
    body = {"messages": QUESTION, "max_tokens": 24, "temperature": 0}
    data = "".join(
        json.dumps({"custom_id": f"run-9-item-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        + "\n"
        for i in range(NUM_REQUESTS)
    )
    log = tmp_path / "server.log"
    with running_server(log, "--batch-max-requests-in-flight", "2") as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        uploaded = client.files.create(file=("in.jsonl", data.encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        poll(client, batch.id, lambda b: b.request_counts.completed >= 2)
        worker = max(psutil.Process(proc.pid).children(recursive=True), key=lambda c: c.memory_info().rss)
        worker.send_signal(signal.SIGKILL)
        done = poll(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
            "completed",
            NUM_REQUESTS,
            0,
        )
        assert done.error_file_id is None
        lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"run-9-item-{i}" for i in range(NUM_REQUESTS)]
    text = log.read_text()
    assert f"batch {batch.id}: the engine stopped serving (" in text
    assert f"batch {batch.id}: the engine is serving again; running the rest of the batch" in text
