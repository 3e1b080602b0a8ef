"""AsyncLLM over the in-process EngineClient: the server's frontend without a worker process."""

from __future__ import annotations

import asyncio

import pytest

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.client import InprocEngineClient
from hybridserve.engine.llm import LLM
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.step_budget import BACKGROUND_PRIORITY
from hybridserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(str(smollm2_dir), dtype="float32", device="cpu", kv_cache_prefault=False)


@pytest.fixture
def engine(llm: LLM, smollm2_dir) -> AsyncLLM:
    """The offline LLM's engine core behind the server's frontend (one core, used by one at a time)."""
    client = InprocEngineClient(llm.core, llm.config)
    return AsyncLLM(client, llm.tokenizer, "smollm2", llm.eos_token_ids, smollm2_dir)


async def _collect(engine: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.chat_prompt([{"role": "user", "content": text}]) for text in ("Hi!", "Name a colour.", "2+2?")]


def test_greedy_tokens_equal_the_offline_api(llm: LLM, engine: AsyncLLM):
    prompts = _prompts(llm)
    expected = [final.outputs[0].token_ids for final in llm.generate(prompts, GREEDY)]

    async def main() -> list[list[RequestOutput]]:
        runs = [_collect(engine, p, GREEDY, f"req-{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*runs)

    results = asyncio.run(main())
    for outs, want in zip(results, expected, strict=True):
        assert [t for out in outs for t in out.output.delta_token_ids] == want
        assert outs[-1].finished and outs[-1].output.finish_reason == "length"
    llm.core.check_integrity()
    assert engine.stats().num_running == 0


def test_fan_out_and_a_stop_string_end_like_the_offline_api(llm: LLM, engine: AsyncLLM):
    """n=2 choices (seeded) and a stop string: the same texts as LLM.generate, and the engine requests the
    stop string ended are aborted."""
    [prompt] = _prompts(llm)[:1]
    params = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=16, stop=["e"])
    [offline] = llm.generate([prompt], params)
    outs = asyncio.run(_collect(engine, prompt, params, "fan"))
    texts = {out.output.index: out.output.text for out in outs if out.finished}
    assert texts == {c.index: c.text for c in offline.outputs}
    assert {out.output.finish_reason for out in outs if out.finished} == {c.finish_reason for c in offline.outputs}
    llm.core.check_integrity()
    assert not llm.core.has_work()


def test_closing_generate_early_aborts_the_engine_request(llm: LLM, engine: AsyncLLM):
    [prompt] = _prompts(llm)[:1]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        stream = engine.generate(prompt, params, "early")
        await anext(stream)
        await stream.aclose()

    asyncio.run(main())
    llm.core.check_integrity()
    assert not llm.core.has_work()


def test_an_idle_engine_wakes_for_the_next_request(llm: LLM, engine: AsyncLLM):
    [prompt] = _prompts(llm)[:1]

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        first = await _collect(engine, prompt, GREEDY, "first")
        await asyncio.sleep(0.05)  # the reader is now waiting for work
        return first, await _collect(engine, prompt, GREEDY, "second")

    first, second = asyncio.run(asyncio.wait_for(main(), 120))
    assert [o.output.delta_token_ids for o in first] == [o.output.delta_token_ids for o in second]
    assert second[-1].finished


def test_online_requests_are_admitted_before_waiting_batch_work(smollm2_dir):
    """One sequence at a time: two batch requests (the batch band) queued before an online one (0) run after it."""
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", max_num_seqs=1, kv_cache_prefault=False)
    client = InprocEngineClient(llm.core, llm.config)
    engine = AsyncLLM(client, llm.tokenizer, "smollm2", llm.eos_token_ids, smollm2_dir)
    prompt = _prompts(llm)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    finished: list[str] = []

    async def run(rid: str, priority: int) -> None:
        async for out in engine.generate(prompt, params, rid, priority):
            if out.finished:
                finished.append(rid)

    async def main() -> None:
        await asyncio.gather(run("batch-0", BACKGROUND_PRIORITY), run("batch-1", BACKGROUND_PRIORITY), run("online", 0))

    asyncio.run(main())
    assert finished == ["online", "batch-0", "batch-1"]
    llm.core.check_integrity()


def test_offline_chat_prompts_are_the_ids_the_server_sends(llm: LLM, engine: AsyncLLM):
    """LLM.chat_prompt renders through the frontend's renderer: the same messages, the same token ids."""
    from fastapi.testclient import TestClient

    from hybridserve.serving.app import build_app

    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    body = {"messages": messages, "max_tokens": 1, "return_token_ids": True}
    with TestClient(build_app(engine, None)) as client:
        served = client.post("/v1/chat/completions", json=body).json()["prompt_token_ids"]
    assert llm.chat_prompt(messages) == served
