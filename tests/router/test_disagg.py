"""Disaggregated prefill and decode against the same engine aggregated (in this process), with real workers on
loopback and NIXL between them: identical greedy tokens and logprobs (and seeded samples) for the default model
and for the hybrid tiny models, whose recurrent state is what the transfer must carry exactly. Covers a prompt
longer than the step budget, a prompt that hits the prefill worker's prefix cache, n > 1, a grammar-constrained
request, and every cache's integrity afterwards."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hybridserve.config import DeploymentConfig, EngineConfig
from hybridserve.engine.async_llm import AsyncLLM, sampling_defaults
from hybridserve.engine.client import InprocEngineClient
from hybridserve.engine.llm import LLM
from hybridserve.router.deploy import build_engine
from hybridserve.sampling_params import SamplingParams, StructuredOutput

ENGINE = {
    "dtype": "float32",
    "kv_cache_memory_bytes": 64 * 1024**2,
    "num_threads": 1,
    "max_num_batched_tokens": 64,  # the long prompt takes several steps
    "num_state_slots": 8,
}
DISAGGREGATED = DeploymentConfig(num_prefill_workers=1, num_decode_workers=1, max_local_prefill_tokens=0)


def _prompts(engine: AsyncLLM) -> list[list[int]]:
    text = "The quick brown fox jumps over the lazy dog. " * 12
    long = engine.tokenizer.encode(text)
    return [
        engine.tokenizer.encode("The capital of France is"),
        long,  # several chunks of the 64-token budget
        long[:-3] + engine.tokenizer.encode(" Then it slept."),  # a prefix hit on the prefill worker
    ]


async def _run(engine: AsyncLLM) -> list[list[tuple[list[int], list[float]]]]:
    """Per request, per choice: (token ids, logprobs of the sampled tokens)."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, n=2, logprobs=0)
    # Constrained: the prefill worker samples the first token under the grammar, the decode worker feeds it in.
    regex = SamplingParams(
        max_tokens=10, temperature=0.0, logprobs=0, structured_output=StructuredOutput(regex="[a-z ]{3,9}")
    )
    first = _prompts(engine)[0]
    jobs = [(p, greedy) for p in _prompts(engine)] + [(first, sampled), (first, regex)]
    results = []
    for i, (prompt, params) in enumerate(jobs):  # one at a time: the third must find the second's blocks
        choices: dict[int, tuple[list[int], list[float]]] = {}
        async for update in engine.generate(prompt, params, f"req-{i}"):
            out = update.output
            assert out.error is None, out.error
            ids, lps = choices.setdefault(out.index, ([], []))
            ids += out.delta_token_ids
            lps += [lp.logprob for lp in out.delta_logprobs or []]
        results.append([choices[k] for k in sorted(choices)])
    return results


def _aggregated(model: Path) -> list:
    """The reference: the same engine in this process (what one aggregated worker runs, without the process)."""
    llm = LLM(str(model), **ENGINE, kv_cache_prefault=False)
    client = InprocEngineClient(llm.core, llm.config)
    engine = AsyncLLM(client, llm.tokenizer, "m", llm.eos_token_ids, model, sampling_defaults(model))
    results = asyncio.run(_run(engine))
    llm.core.check_integrity()
    return results


def _disaggregated(model: Path, staging_min_run: float) -> tuple[list, dict]:
    config = EngineConfig.of(model=str(model), **ENGINE, kv_staging_min_run=staging_min_run, kv_cache_prefault=False)
    engine = build_engine(config, DISAGGREGATED)

    async def go() -> tuple[list, dict]:
        results = await _run(engine)
        router = engine.client
        for _ in range(100):  # the prefill side frees on the decode side's acknowledgement
            reports = await router.check_integrity()
            if all(r.stats.kv_held == 0 and r.stats.kv_pulling == 0 for r in reports.values()):
                break
            await asyncio.sleep(0.05)
        return results, reports

    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


ALWAYS, NEVER = float("inf"), 0.0  # staging: every request's KV packed into the arenas, or read from the blocks


@pytest.mark.parametrize(
    ("model", "staging"),
    [
        pytest.param("smollm2_dir", NEVER, id="smollm2-direct"),
        # Staged attention planes: the byte plan is checked in the default run (test_kv_transfer_layout.py).
        pytest.param("smollm2_dir", ALWAYS, id="smollm2-staged", marks=pytest.mark.slow),
        pytest.param("kimi_linear_dir", ALWAYS, id="kimi-linear-staged"),
        pytest.param("kimi_k3_dir", NEVER, id="kimi-k3-direct"),
    ],
)
def test_disaggregated_equals_aggregated(model: str, staging: float, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    expected = _aggregated(path)
    got, reports = _disaggregated(path, staging)
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        for choice, ((want_ids, want_lps), (ids, lps)) in enumerate(zip(want, have, strict=True)):
            assert ids == want_ids, f"request {i} choice {choice}"
            assert lps == pytest.approx(want_lps, abs=1e-4), f"request {i} choice {choice}"
    prefill, decode = reports["local-prefill-0"].stats, reports["local-decode-0"].stats
    assert all(r.error is None for r in reports.values()), {n: r.error for n, r in reports.items()}
    # Every choice that went on past its first token was read, none recomputed.
    pulls = sum(len(ids) > 1 for choices in expected for ids, _ in choices)
    assert pulls >= 4 and decode.kv_pulls_done == pulls and decode.kv_pulls_failed == 0
    assert decode.kv_pulled_kv_bytes > 0
    assert prefill.kv_held == 0
    # Staged: each side packed (prefill) or scattered (decode) every read request's KV; direct: none.
    assert (prefill.kv_staged, decode.kv_staged) == ((pulls, pulls) if staging == ALWAYS else (0, 0))
    assert prefill.prefix_cache_hits > 0  # the third prompt, and the second choice of the fourth
    hybrid = model != "smollm2_dir"
    assert (decode.kv_pulled_state_bytes > 0) == hybrid
    if hybrid:
        assert prefill.state_snapshot_hits > 0
