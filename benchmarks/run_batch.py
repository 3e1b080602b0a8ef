"""Offline batch runs side by side: the same N-request JSONL through `hybridserve run-batch` and `vllm run-batch`.

Each tool runs once, alone, in its own process group, from process start to exit (model load included: what
a user of the command waits for), while the summed RSS of its process tree is sampled every 0.2 s. Every
request is a chat completion with a unique tag in front of its prompt (no prefix-cache sharing), temperature
0 and `ignore_eos`, so each one generates exactly --max-tokens tokens; output tokens are counted from the
`usage` of each result line. vLLM is the CPU build ../shared/bench/peer-vllm.sh installs under $PEER_ROOT
(default /tmp/peer); without it that row is skipped with a message. Writes <out>/run_batch_<stamp>.csv and
.png (the JSONL files under <out>/tmp/, the logs beside the results) and prints a markdown table; progress
goes to stderr.

  .venv/bin/python benchmarks/run_batch.py                                # 256 requests of 64 tokens
  .venv/bin/python benchmarks/run_batch.py --requests 16 --max-tokens 16 --tools hybridserve   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import MODEL, same_dtype_as_engine, vllm_command, vllm_env, vllm_missing  # noqa: E402
from report import write_csv  # noqa: E402
from serving_compare import REPO, PeakRss, log_tail, say  # noqa: E402

TOOLS = ("hybridserve", "vllm")
TITLES = {"hybridserve": "hybridserve run-batch", "vllm": "vllm run-batch (CPU)"}
TOPICS = ("a lighthouse keeper", "a lost robot", "the ocean", "a mountain village", "a clockmaker", "a dragon")


@dataclass(frozen=True)
class Row:
    tool: str
    requests: int
    max_tokens: int
    errors: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    peak_rss_mib: float


def input_lines(requests: int, max_tokens: int, tag: str) -> list[str]:
    """The batch's JSONL lines (newline-terminated): chat completions, a unique tag per prompt, greedy."""
    lines = []
    for i in range(requests):
        content = f"[{tag}-{i}] Write a long story about {TOPICS[i % len(TOPICS)]}."
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        line = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        lines.append(json.dumps(line) + "\n")
    return lines


def write_input(path: Path, requests: int, max_tokens: int, tag: str) -> None:
    path.write_text("".join(input_lines(requests, max_tokens, tag)))


def command(tool: str, source: Path, output: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    files = ["-i", str(source), "-o", str(output)]
    if tool == "hybridserve":
        env["PYTHONPATH"] = str(REPO)  # this checkout's code, whatever the interpreter has installed
        exe = [sys.executable, "-m", "hybridserve.serving.cli", "run-batch"]
        return [*exe, *files, *shlex.split(args.hybridserve_args)], env
    command = vllm_command(args.peer_root, "vllm.entrypoints.openai.run_batch", args.vllm_dtype)
    return [*command, *files, *shlex.split(args.vllm_args)], vllm_env(args.peer_root)


def count_output(path: Path, requests: int) -> tuple[int, int]:
    """(errors, output tokens) of a result file: a request without a 200 line is an error."""
    tokens = ok = 0
    if path.exists():
        for text in path.read_text().splitlines():
            response = json.loads(text).get("response") or {}
            if response.get("status_code") == 200:
                ok += 1
                tokens += response["body"]["usage"]["completion_tokens"]
    return requests - ok, tokens


def run_tool(tool: str, args: argparse.Namespace, source: Path) -> Row:
    output = args.out / "tmp" / f"run_batch_{args.stamp}_{tool}_out.jsonl"
    log = args.out / f"run_batch_{args.stamp}_{tool}.log"
    output.unlink(missing_ok=True)
    cmd, env = command(tool, source, output, args)
    say(f"{tool}: `{shlex.join(cmd)}`, log {log}")
    start = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with PeakRss(proc.pid) as rss:
            code = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    wall = time.monotonic() - start
    if code != 0:
        raise RuntimeError(f"{tool} exited with code {code}; {log}:\n{log_tail(log)}")
    errors, tokens = count_output(output, args.requests)
    row = Row(
        tool, args.requests, args.max_tokens, errors, tokens, round(wall, 2), round(tokens / wall, 1),
        round(rss.peak / 2**20, 1),
    )  # fmt: skip
    say(f"{tool}: {row.output_tok_s} output tok/s, {row.wall_s} s, peak RSS {row.peak_rss_mib} MiB, {errors} errors")
    return row


def write_png(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4), layout="constrained")
    names = [TITLES[row.tool] for row in rows]
    for ax, field, title in zip(
        axes,
        ("wall_s", "output_tok_s", "peak_rss_mib"),
        ("Wall time (s, model load included)", "Output tokens/s", "Peak RSS (MiB)"),
        strict=True,
    ):
        ax.bar(names, [getattr(row, field) for row in rows], color=["C0", "C1"][: len(rows)])
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    first = rows[0]
    fig.suptitle(f"{MODEL} on CPU ({os.cpu_count()} cores): {first.requests} requests of {first.max_tokens} tokens")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(rows: list[Row]) -> str:
    head = ["tool", "requests", "max tokens", "errors", "output tokens", "wall s", "output tok/s", "peak RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [TITLES[row.tool], *(str(v) for k, v in asdict(row).items() if k != "tool")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default="hybridserve,vllm", help="comma list from: " + ", ".join(TOOLS))
    p.add_argument("--requests", type=int, default=256, help="lines in the batch input")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results folder")
    p.add_argument("--bench-dir", type=Path, default=REPO.parent / "shared" / "bench", help="peer scripts")
    p.add_argument("--peer-root", type=Path, default=Path(os.environ.get("PEER_ROOT", "/tmp/peer")), help="peers")
    p.add_argument("--hybridserve-args", default="", help="extra arguments for `hybridserve run-batch`, one string")
    p.add_argument("--vllm-dtype", default=same_dtype_as_engine(), help="vLLM's --dtype (default: the engine's auto)")
    p.add_argument("--vllm-args", default="", help="extra arguments for `vllm run-batch`, one string")
    args = p.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if not args.tools or any(t not in TOOLS for t in args.tools):
        p.error(f"--tools: expected a comma list from {', '.join(TOOLS)}, got {','.join(args.tools)!r}")
    if args.requests < 1 or args.max_tokens < 1:
        p.error(f"--requests and --max-tokens must be positive, got {args.requests} and {args.max_tokens}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("matplotlib is missing: .venv/bin/pip install -e '.[bench]'")
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    (args.out / "tmp").mkdir(parents=True, exist_ok=True)  # the JSONL files (not committed)
    source = args.out / "tmp" / f"run_batch_{args.stamp}_in.jsonl"
    write_input(source, args.requests, args.max_tokens, args.stamp)
    rows: list[Row] = []
    for tool in args.tools:
        if tool == "vllm" and (why := vllm_missing(args.peer_root, args.bench_dir)) is not None:
            say(f"vllm: skipped: {why}")
            continue
        rows.append(run_tool(tool, args, source))
    if not rows:
        say("nothing ran")
        return 1
    csv_path, png_path = args.out / f"run_batch_{args.stamp}.csv", args.out / f"run_batch_{args.stamp}.png"
    write_csv([asdict(row) for row in rows], csv_path)
    write_png(rows, png_path)
    say(f"wrote {csv_path} and {png_path}")
    print(markdown_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
