"""lm-evaluation-harness, unchanged, against a real server: `local-completions` scoring a multiple-choice task
(loglikelihood: echo with logprobs) and `local-chat-completions` answering a generate_until task, both defined
from local files (no download). The scores it reports must be what the server's own logprobs and answers give."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.e2e.test_e2e_server import KEY, running_server

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # a server start-up and two lm_eval runs (each imports for ~10 s): about a minute

CAPITALS = [
    ("France", ["Paris", "Berlin", "Madrid"], 0),
    ("Germany", ["Rome", "Berlin", "Lisbon"], 1),
    ("Italy", ["Vienna", "Oslo", "Rome"], 2),
    ("Spain", ["Madrid", "Athens", "Dublin"], 0),
    ("Japan", ["Seoul", "Tokyo", "Beijing"], 1),
]
QUESTIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("What is 2 + 2?", "4"),
]
MC_TASK = """\
task: hybridserve_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: hybridserve_questions
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("lm-eval-server") / "server.log"
    with running_server(log, "--dtype", "float32") as (url, _):
        yield url


def _write_task(directory: Path, template: str, name: str, rows: list[dict]) -> None:
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / f"{name}.yaml").write_text(template.format(data=data))


def _lm_eval(tmp_path: Path, model: str, model_args: str, task: str, *extra: str) -> tuple[dict, list[dict]]:
    """Runs lm_eval's CLI offline; its aggregated results for `task` and its logged samples."""
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OPENAI_API_KEY": KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "HF_HOME": str(tmp_path / "hf"),
    }
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        task,
        "--include_path",
        str(tmp_path),
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return json.loads(results.read_text())["results"][task], sorted(rows, key=lambda r: r["doc_id"])


def _loglikelihood(server: str, tokenizer, context: str, continuation: str) -> float:
    """The continuation's logprob given the context, from the server's own prompt logprobs (vLLM's field),
    tokenized as lm-eval does (the whole, then the context's length off it)."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    n_context = len(tokenizer(context, add_special_tokens=False).input_ids)
    body = {"model": "smollm2", "prompt": whole, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    prompt = r.json()["choices"][0]["prompt_logprobs"]
    return sum(prompt[p][str(whole[p])]["logprob"] for p in range(n_context, len(whole)))


def test_local_completions_loglikelihood(server, smollm2_dir, tmp_path):
    rows = [{"country": c, "choices": choices, "answer": a} for c, choices, a in CAPITALS]
    _write_task(tmp_path, MC_TASK, "capitals", rows)
    model_args = (
        f"model=smollm2,base_url={server}/v1/completions,tokenizer={smollm2_dir},tokenizer_backend=huggingface,"
        "tokenized_requests=True,max_retries=1"
    )
    # three requests scored per call: a prompt that is a list of token-id lists
    results, samples = _lm_eval(tmp_path, "local-completions", model_args, "hybridserve_capitals", "--batch_size", "3")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    correct = []
    for (country, choices, answer), sample in zip(CAPITALS, samples, strict=True):
        context = f"Question: What is the capital of {country}?\nAnswer:"
        ours = [_loglikelihood(server, tokenizer, context, " " + choice) for choice in choices]
        theirs = [float(resp[0][0]) for resp in sample["resps"]]  # the samples file writes them as text
        assert theirs == pytest.approx(ours, abs=1e-4), country
        correct.append(max(range(len(ours)), key=ours.__getitem__) == answer)
    assert results["acc,none"] == pytest.approx(sum(correct) / len(correct))
    assert sum(correct) >= 3  # SmolLM2 knows most of these capitals


def test_local_chat_completions_generate_until(server, smollm2_dir, tmp_path):
    _write_task(tmp_path, GEN_TASK, "questions", [{"question": q, "answer": a} for q, a in QUESTIONS])
    model_args = f"model=smollm2,base_url={server}/v1/chat/completions,max_retries=1"
    results, samples = _lm_eval(
        tmp_path, "local-chat-completions", model_args, "hybridserve_questions", "--apply_chat_template"
    )
    matches = []
    for (question, answer), sample in zip(QUESTIONS, samples, strict=True):
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 16,
            "temperature": 0,
            "stop": ["\n\n"],
        }
        r = httpx.post(f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        ours = r.json()["choices"][0]["message"]["content"]
        assert sample["filtered_resps"] == [ours], question
        matches.append(ours == answer)
    assert results["exact_match,none"] == pytest.approx(sum(matches) / len(matches))
    assert matches[0]  # "The capital of France is Paris."
