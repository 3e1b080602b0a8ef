"""Compare two running deployments of one model request by request: an aggregated one (the reference) and a
disaggregated one (the candidate), or any two. Same prompts (short ones, one longer than a step budget, one that
shares a long prefix with it, a seeded n=2), greedy and seeded sampling through /v1/completions with logprobs;
reports every difference in text, tokens or logprobs beyond a tolerance. Exits 1 when they differ.

  python scripts/disagg_parity.py --reference http://127.0.0.1:8000 --candidate http://127.0.0.1:8001 \
      --model smollm2 [--api-key KEY] [--tolerance 1e-3]

Send the long prompts twice (`--rounds 2`) to check prefix-cache hits on both sides as well.
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx

LONG = "The quick brown fox jumps over the lazy dog while the river runs past the old mill. " * 40
PROMPTS = [
    ({"prompt": "The capital of France is", "max_tokens": 16}, "short, greedy"),
    ({"prompt": LONG + "In one sentence, the fox", "max_tokens": 16}, "longer than a step budget"),
    ({"prompt": LONG + "Meanwhile the dog", "max_tokens": 16}, "a shared long prefix"),
    ({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "seed": 1234, "n": 2}, "seeded, n=2"),
]


def complete(url: str, model: str, key: str, body: dict) -> list[dict]:
    request = {"model": model, "temperature": 0.0, "logprobs": 5, **body}
    response = httpx.post(
        url.rstrip("/") + "/v1/completions", json=request, headers={"Authorization": f"Bearer {key}"}, timeout=600
    )
    if response.status_code != 200:
        raise SystemExit(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
    return sorted(response.json()["choices"], key=lambda c: c["index"])


def differences(want: list[dict], got: list[dict], tolerance: float) -> list[str]:
    problems = []
    for a, b in zip(want, got, strict=True):
        where = f"choice {a['index']}"
        if a["text"] != b["text"]:
            problems.append(f"{where}: text {b['text']!r} != {a['text']!r}")
        la, lb = a["logprobs"], b["logprobs"]
        if la["tokens"] != lb["tokens"]:
            problems.append(f"{where}: tokens {lb['tokens']} != {la['tokens']}")
            continue
        for i, (x, y) in enumerate(zip(la["token_logprobs"], lb["token_logprobs"], strict=True)):
            if abs(x - y) > tolerance:
                problems.append(f"{where}: token {i} ({la['tokens'][i]!r}) logprob {y:.6f} != {x:.6f}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", required=True, help="base URL of the reference deployment (aggregated)")
    p.add_argument("--candidate", required=True, help="base URL of the deployment under test (disaggregated)")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default="none")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest logprob difference allowed")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    failed = 0
    for round_ in range(args.rounds):
        for body, what in PROMPTS:
            want = complete(args.reference, args.model, args.api_key, body)
            got = complete(args.candidate, args.model, args.api_key, body)
            problems = differences(want, got, args.tolerance)
            failed += bool(problems)
            status = "same" if not problems else "DIFFERENT"
            print(json.dumps({"round": round_, "prompt": what, "result": status, "problems": problems}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
