"""Speculative decoding over HTTP: hybridserve plain / ngram / suffix against vLLM's CPU build plain / ngram.

    .venv/bin/python -m benchmarks.spec_serving                                # every side, conc 1,4
    .venv/bin/python -m benchmarks.spec_serving --sides hybridserve,hybridserve-suffix --conc 1 --requests 2

The workload is spec_decode.py's "rewrite this text with one change" (8 requests, a paragraph each to copy with
one word replaced; --requests takes fewer), sent to the OpenAI Chat Completions API, greedy, up to --max-tokens
each, at each --conc level: `conc` requests in flight at once until all are answered. One server at a time on
--port, each in its own process group, healthy and warmed up before the load (serving_compare.py's helpers) and
stopped in `finally` (on Ctrl-C and SIGTERM too); every wait is bounded (--startup-timeout, --request-timeout).

Sides: hybridserve (this checkout's `hybridserve serve`, default model, --hybridserve-args appended),
hybridserve-ngram (`{"method": "ngram", "num_speculative_tokens": --k, "prompt_lookup_max": 4}`),
hybridserve-suffix (`{"method": "suffix", "num_speculative_tokens": --suffix-k}` with --suffix-config's keys;
the cross-request cache is off unless that names suffix_decoding_max_cached_requests, since a later level would
draft from the earlier level's identical outputs), vllm and vllm-ngram (vLLM's api_server from --peer-root as
peers.py starts it, in the engine's `--dtype auto` unless --vllm-dtype, the same ngram keys).

Output tok/s is completion tokens over the level's wall time; acceptance is accepted over drafted tokens from the
server's /metrics (hybridserve:… and vllm:spec_decode_num_{draft,accepted}_tokens_total). Each side's texts are
compared with its engine's plain side when that ran first (greedy: they must be the same). Writes
<out>/spec_serving_<stamp>.csv and .png and a log per server; prints a markdown table (progress on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import MODEL, same_dtype_as_engine, vllm_command, vllm_env, vllm_missing  # noqa: E402
from report import write_csv  # noqa: E402
from serving_compare import REPO, ServerFailed, _raise_interrupt, say, started  # noqa: E402
from spec_decode import rewrite_texts  # noqa: E402

SIDES = ("hybridserve", "hybridserve-ngram", "hybridserve-suffix", "vllm", "vllm-ngram")
_COUNTER = re.compile(r"^\w+:spec_decode_num_(draft|accepted)_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def ngram_config(k: int) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}


def server(side: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str] | None]:
    """The side's command line and environment (None: this one's)."""
    spec: dict[str, object] | None = None
    if side.endswith("-ngram"):
        spec = ngram_config(args.k)
    elif side.endswith("-suffix"):
        spec = {"method": "suffix", "num_speculative_tokens": args.suffix_k, "suffix_decoding_max_cached_requests": 0}
        spec.update(json.loads(args.suffix_config))
    flags = [] if spec is None else ["--speculative-config", json.dumps(spec)]
    address = ["--port", str(args.port)]
    if side.startswith("hybridserve"):
        extra = args.hybridserve_args.split()
        return [sys.executable, "-m", "hybridserve.serving.cli", "serve", *address, *flags, *extra], None
    api = vllm_command(args.peer_root, "vllm.entrypoints.openai.api_server", args.vllm_dtype)
    return [*api, "--host", "127.0.0.1", *address, *flags], vllm_env(args.peer_root)


def chat(url: str, text: str, max_tokens: int, timeout: float) -> tuple[str, int, float]:
    """One greedy chat completion: its text, completion tokens and seconds."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    body["temperature"] = 0.0
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.load(response)
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"], time.perf_counter() - start


def spec_counts(url: str) -> dict[str, float]:
    """Draft and accepted tokens so far, summed over the server's series (zero without speculation)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    counts = {"draft": 0.0, "accepted": 0.0}
    for kind, value in _COUNTER.findall(text):
        counts[kind] += float(value)
    return counts


def run_level(side: str, url: str, conc: int, args: argparse.Namespace) -> tuple[dict[str, object], list[str]]:
    texts = rewrite_texts()[: args.requests]
    before = spec_counts(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        results = list(pool.map(lambda t: chat(url, t, args.max_tokens, args.request_timeout), texts))
    wall = time.perf_counter() - start
    after = spec_counts(url)
    drafted, accepted = after["draft"] - before["draft"], after["accepted"] - before["accepted"]
    tokens = sum(r[1] for r in results)
    row: dict[str, object] = {
        "side": side,
        "conc": conc,
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1),
        "latency_p50_s": round(statistics.median(r[2] for r in results), 2),
        "acceptance": round(accepted / drafted, 3) if drafted else "",
    }
    say(f"{side} conc {conc}: {row['output_tok_s']} tok/s, acceptance {row['acceptance'] or '-'}, wall {wall:.1f} s")
    return row, [r[0] for r in results]


@contextmanager
def serving(side: str, args: argparse.Namespace, log: Path) -> Iterator[str]:
    command, env = server(side, args)
    with started(side, command, env, args, log):
        yield f"http://127.0.0.1:{args.port}"


def bench(args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    plain_texts: dict[tuple[str, int], list[str]] = {}  # per engine and level: the plain side's answers
    for side in args.sides:
        if side.startswith("vllm") and (why := vllm_missing(args.peer_root, args.bench_dir)) is not None:
            say(f"{side}: skipped: {why}")
            continue
        try:
            with serving(side, args, args.out / f"{side}_{args.stamp}.log") as url:
                for conc in args.conc:
                    row, texts = run_level(side, url, conc, args)
                    engine = side.split("-")[0]
                    if side == engine:
                        plain_texts[engine, conc] = texts
                    reference = plain_texts.get((engine, conc))
                    row["same_text_as_plain"] = "" if reference is None else texts == reference
                    rows.append(row)
        except (ServerFailed, OSError) as exc:  # it would not start, or a request failed: the next side
            say(f"ERROR: {side}: {exc}")
    return rows


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = list(dict.fromkeys(str(r["side"]) for r in rows))
    concs = sorted({int(str(r["conc"])) for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        values = [next((r["output_tok_s"] for r in rows if (r["side"], r["conc"]) == (side, c)), 0) for c in concs]
        ax.bar([j + i * width for j in range(len(concs))], values, width, label=side)  # type: ignore[arg-type]
    ax.set_xticks([j + width * (len(sides) - 1) / 2 for j in range(len(concs))], [f"conc {c}" for c in concs])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{MODEL}, rewrite with one change, over HTTP")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", default=",".join(SIDES), help="comma list from: " + ", ".join(SIDES))
    p.add_argument("--conc", default="1,4", help="requests in flight at once, one level each")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=8, help="the first this many of the 8 rewrite requests")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the ngram sides")
    p.add_argument("--suffix-k", type=int, default=8, help="num_speculative_tokens of hybridserve-suffix")
    p.add_argument("--suffix-config", default="{}", help="more --speculative-config keys for hybridserve-suffix")
    p.add_argument("--hybridserve-args", default="", help="extra arguments for `hybridserve serve`")
    p.add_argument("--peer-root", type=Path, default=Path(os.environ.get("PEER_ROOT", "/tmp/peer")), help="peers")
    p.add_argument("--bench-dir", type=Path, default=REPO.parent / "shared" / "bench", help="peer scripts")
    p.add_argument("--vllm-dtype", default=same_dtype_as_engine(), help="vLLM's --dtype (default: the engine's auto)")
    p.add_argument("--port", type=int, default=8019, help="the port each server binds in turn (127.0.0.1)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    if not args.sides or any(s not in SIDES for s in args.sides):
        p.error(f"--sides: expected a comma list from {', '.join(SIDES)}, got {','.join(args.sides)!r}")
    try:
        args.conc = [int(c) for c in args.conc.split(",")]
        if not isinstance(json.loads(args.suffix_config), dict):
            raise ValueError(args.suffix_config)
    except ValueError as exc:
        p.error(f"--conc must be integers and --suffix-config a JSON object: {exc}")
    if any(c < 1 for c in args.conc) or min(args.max_tokens, args.requests) < 1:
        numbers = f"{args.conc}, {args.max_tokens}, {args.requests}"
        p.error(f"--conc, --max-tokens and --requests must be positive, got {numbers}")
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so `finally` stops the server on kill too
    try:
        rows = bench(args)
    except KeyboardInterrupt as exc:
        say(f"interrupted ({str(exc) or 'Ctrl-C'}); server stopped")
        return 130
    if not rows:
        say("no side ran")
        return 1
    csv_path = args.out / f"spec_serving_{args.stamp}.csv"
    write_csv(rows, csv_path)
    plot(rows, csv_path.with_suffix(".png"))
    print("| side | conc | output tok/s | latency p50 s | acceptance | same text as plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        row = [r["side"], r["conc"], r["output_tok_s"], r["latency_p50_s"], r["acceptance"], r["same_text_as_plain"]]
        print("| " + " | ".join(str(v) for v in row) + " |")
    say(f"wrote {csv_path} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
