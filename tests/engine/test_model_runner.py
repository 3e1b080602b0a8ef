"""The model runner driven by hand-written step plans: no scheduler, no Request.

Greedy tokens from plans written here (chunked prefill, block-table diffs, a resumption after preemption with
a new table) must equal what the whole engine generates, and the recurrent-state operations of a plan must
let a hybrid model resume exactly from a snapshot.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.engine.plan import NewRequest, ScheduledRequest, SchedulerOutput
from hybridserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BS = 16


def new(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> NewRequest:
    return NewRequest(rid, prompt, params, [])


def run(llm: LLM, plan: SchedulerOutput) -> dict[str, int]:
    runner = llm.core.runner
    return {rid: r.token_id for rid, r in runner.sample(plan, runner.forward(plan)).items()}


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(
        str(smollm2_dir), dtype="float32", device="cpu", block_size=BS, num_kv_blocks=64, kv_cache_prefault=False
    )


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return [
        llm.chat_prompt([{"role": "user", "content": "Name three colours."}]),
        llm.chat_prompt([{"role": "user", "content": "Write one sentence about the sea and its long waves."}]),
    ]


@pytest.fixture(scope="module")
def expected(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def blocks_for(num_tokens: int, first: int) -> list[int]:
    return list(range(first, first + -(-num_tokens // BS)))


def test_hand_written_plans_give_the_engines_greedy_tokens(llm, prompts, expected) -> None:
    a, b = prompts
    assert len(b) > 40, "b is prefilled in two chunks"
    # Blocks 0-15 for a, 16-31 for b: each table grows by diffs as its tokens cross block boundaries.
    tables = {"a": blocks_for(len(a) + 12, 0), "b": blocks_for(len(b) + 12, 16)}
    sent = {"a": -(-len(a) // BS), "b": -(-30 // BS)}
    out = run(
        llm,
        SchedulerOutput(
            [
                ScheduledRequest("ra", 0, a, tables["a"][: sent["a"]], True, True),
                ScheduledRequest("rb", 0, b[:30], tables["b"][: sent["b"]], True, False),
            ],
            [new("ra", a), new("rb", b)],
        ),
    )
    assert list(out) == ["ra"]  # b's first chunk samples nothing
    tokens = {"a": [out["ra"]], "b": []}
    chunk = ScheduledRequest("rb", 30, b[30:], tables["b"][sent["b"] : -(-len(b) // BS)], False, True)
    sent["b"] = -(-len(b) // BS)
    pending = [chunk]
    while len(tokens["a"]) < 12 or len(tokens["b"]) < 12:
        steps = list(pending)
        pending = []
        if len(tokens["a"]) < 12:
            pos = len(a) + len(tokens["a"]) - 1
            need = pos // BS + 1
            steps.append(ScheduledRequest("ra", pos, [tokens["a"][-1]], tables["a"][sent["a"] : need], False, True))
            sent["a"] = max(sent["a"], need)
        if tokens["b"] and len(tokens["b"]) < 12:
            pos = len(b) + len(tokens["b"]) - 1
            need = pos // BS + 1
            steps.append(ScheduledRequest("rb", pos, [tokens["b"][-1]], tables["b"][sent["b"] : need], False, True))
            sent["b"] = max(sent["b"], need)
        for rid, token in run(llm, SchedulerOutput(steps)).items():
            tokens[rid[1]].append(token)
    assert [tokens["a"], tokens["b"]] == expected
    run(llm, SchedulerOutput([], finished_ids=["ra", "rb"]))
    assert not {"ra", "rb"} & set(llm.core.runner.requests)


def test_a_resumed_request_recomputes_on_a_new_table(llm, prompts, expected) -> None:
    """What preemption looks like to the runner: the same id, scheduled again from position 0 with its
    prompt and the tokens it produced, on other blocks (full_table), and no NewRequest."""
    a = prompts[0]

    def decode(tokens: list[int], first_block: int) -> int:
        pos = len(a) + len(tokens) - 1  # a new block opens when the token lands on a boundary
        diff = [first_block + pos // BS] if pos % BS == 0 else []
        return run(llm, SchedulerOutput([ScheduledRequest("p", pos, [tokens[-1]], diff, False, True)]))["p"]

    prefill = ScheduledRequest("p", 0, a, blocks_for(len(a), 0), True, True)
    tokens = [run(llm, SchedulerOutput([prefill], [new("p", a)]))["p"]]
    for _ in range(4):
        tokens.append(decode(tokens, 0))
    known = a + tokens
    resumed = ScheduledRequest("p", 0, known, blocks_for(len(known), 40), True, True)
    tokens.append(run(llm, SchedulerOutput([resumed]))["p"])
    while len(tokens) < 12:
        tokens.append(decode(tokens, 40))
    assert tokens == expected[0]
    run(llm, SchedulerOutput([], finished_ids=["p"]))


def test_a_plan_naming_an_unknown_request_is_refused(llm) -> None:
    plan = SchedulerOutput([ScheduledRequest("nobody", 0, [1, 2], [0], True, True)])
    with pytest.raises(RuntimeError, match="'nobody', which no plan introduced"):
        llm.core.runner.forward(plan)


def test_state_operations_on_a_model_without_state_are_refused(llm) -> None:
    with pytest.raises(RuntimeError, match="keeps no recurrent state"):
        llm.core.runner.forward(SchedulerOutput([], zero_slots=[0]))


def test_plans_survive_serialisation(prompts) -> None:
    import msgspec

    plan = SchedulerOutput(
        [ScheduledRequest("a", 0, prompts[0], [0, 1], True, True, 3)],
        [new("a", prompts[0])],
        ["old"],
        [3],
        [(1, 3)],
        [(3, 2)],
    )
    wire = msgspec.msgpack.encode(plan)
    assert msgspec.msgpack.decode(wire, type=SchedulerOutput) == plan


def test_hybrid_model_resumes_exactly_from_a_snapshot_the_plan_saved(kimi_linear_dir) -> None:
    """A plan zeroes a slot, prefills to a block boundary and saves the slot; a second request restores that
    snapshot into another slot, shares the first block's KV, and computes the rest: same logits, same token."""
    llm = LLM(
        str(kimi_linear_dir),
        dtype="float32",
        device="cpu",
        block_size=8,
        num_kv_blocks=16,
        num_state_slots=2,
        kv_cache_prefault=False,
    )
    runner = llm.core.runner
    assert runner.state_tensors is not None and runner.num_state_snapshots == 2
    prompt = list(range(3, 23))  # 20 tokens: a boundary at 8 and 16
    first = SchedulerOutput(
        [ScheduledRequest("a", 0, prompt[:8], [0, 1, 2], True, False, 0)],
        [new("a", prompt)],
        zero_slots=[0],
        save_snapshots=[(0, 1)],
    )
    runner.forward(first)
    rest_a = SchedulerOutput([ScheduledRequest("a", 8, prompt[8:], [], False, True, 0)])
    logits_a = runner.model.compute_logits(runner.forward(rest_a))
    # b shares block 0 (the first 8 tokens' KV) and resumes from the snapshot, in slot 1, in one step.
    shared = SchedulerOutput(
        [ScheduledRequest("b", 8, prompt[8:], [0, 3, 4], True, True, 1)],
        [new("b", prompt)],
        finished_ids=["a"],
        restore_snapshots=[(1, 1)],
    )
    logits_b = runner.model.compute_logits(runner.forward(shared))
    torch.testing.assert_close(logits_b, logits_a, rtol=0, atol=1e-5)
    assert logits_b[-1].argmax() == logits_a[-1].argmax()
    # Without the restore the slot would hold a's final state, not the state after 8 tokens: different logits.
    wrong = SchedulerOutput([ScheduledRequest("c", 8, prompt[8:], [0, 5, 6], True, True, 0)], [new("c", prompt)])
    assert not torch.allclose(runner.model.compute_logits(runner.forward(wrong)), logits_a, atol=1e-3)
    runner.forward(SchedulerOutput([], finished_ids=["b", "c"]))
    runner.check_integrity()


def _resident_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(size, resident) in bytes of the mapping that holds t's memory, from /proc/self/smaps."""
    at, mapping = t.data_ptr(), None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = (lo, hi) if lo <= at < hi else None
            elif mapping is not None and head == "Rss:":
                return mapping[1] - mapping[0], int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {at:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_kv_cache_prefault_takes_every_page_at_start_up(smollm2_dir) -> None:
    """Without kv_cache_prefault the cache's pages are taken as blocks are first written; with it (the default
    outside the tests) every page of every layer's cache is resident before the first request."""
    lazy = LLM(
        str(smollm2_dir), dtype="float32", device="cpu", block_size=BS, num_kv_blocks=256, kv_cache_prefault=False
    )
    size, resident = _resident_bytes(lazy.core.runner.kv_caches[0])
    assert resident < size // 2
    eager = LLM(
        str(smollm2_dir), dtype="float32", device="cpu", block_size=BS, num_kv_blocks=256, kv_cache_prefault=True
    )
    for cache in eager.core.runner.kv_caches:
        size, resident = _resident_bytes(cache)
        assert resident == size, f"{resident} of {size} bytes resident"


def test_kv_cache_prefault_writes_a_hybrid_models_state_pool_too(kimi_linear_dir) -> None:
    """The recurrent-state slots and their snapshots come from the same allocator as the paged caches."""
    llm = LLM(
        str(kimi_linear_dir), dtype="float32", device="cpu", block_size=8, num_kv_blocks=16, kv_cache_prefault=True
    )
    state = llm.core.runner.state_tensors
    assert state is not None and state.snapshots
    for tensor in (t for layer in (*state.slots, *state.snapshots) for t in layer):
        size, resident = _resident_bytes(tensor)
        assert resident == size, f"{resident} of {size} bytes resident"


_FREED = """
import sys, torch
from hybridserve.engine.model_runner import keep_freed_buffers
if sys.argv[1] == "keep":
    assert keep_freed_buffers()
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // 2**20
buffer = torch.ones(3 * 2**21)  # 24 MiB, written
held = rss_mib()
del buffer
print(held - rss_mib())
"""


def test_freed_step_buffers_stay_for_the_next_step() -> None:
    """keep_freed_buffers (the runner calls it on CPU): a freed 24 MiB buffer, a step's activations, stays in the
    process for the next step. By default glibc hands it back to the kernel, and the next step's pages fault in
    again one by one."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")

    def released_mib(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _FREED, mode], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    assert released_mib("default") == 24
    assert released_mib("keep") == 0
