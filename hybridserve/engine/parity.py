"""Logits at every position of one sequence, computed in chunks through the engine's own attention paths.

For parity checks against a reference implementation (tests, benchmarks/device_check.py). It drives the model
runner with hand-made step plans over cache blocks 0..n (and, for models with linear attention, state slot 0)
of an idle runner, so never call it on a runner that is serving requests.
"""

from __future__ import annotations

import torch

from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.plan import NewRequest, ScheduledRequest, SchedulerOutput
from hybridserve.sampling_params import SamplingParams

_ID = "parity"


def chunked_logits(runner: ModelRunner, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits, computing the chunks that end at `cuts` (ascending, last = len(ids)):
    a first chunk is a fresh prefill, later multi-token chunks prefill on cached context, one-token chunks
    take the decode path."""
    table = list(range(-(-len(ids) // runner.block_size)))
    slot = -1 if runner.state_tensors is None else 0
    logits, start = [], 0
    try:
        with torch.inference_mode():
            for end in cuts:
                first = start == 0
                step = ScheduledRequest(
                    _ID, start, ids[start:end], table if first else [], first, end == len(ids), slot
                )
                plan = SchedulerOutput(
                    [step],
                    # the prompt ends at the first cut: the runner takes later one-token chunks for decodes
                    [NewRequest(_ID, ids[:end], SamplingParams(), [])] if first else [],
                    zero_slots=[slot] if first and slot >= 0 else [],
                )
                logits.append(runner.model.compute_logits(runner.forward(plan)))
                start = end
    finally:
        runner.forward(SchedulerOutput([], finished_ids=[_ID]))
    return torch.cat(logits)
