"""Logits at every position of one sequence, computed in chunks through the engine's own attention paths.

For parity checks against a reference implementation (tests, benchmarks/device_check.py). It uses cache
blocks 0..n (and, for models with linear attention, a state slot it takes and gives back) of an idle runner,
so never call it on a runner that is serving requests.
"""

from __future__ import annotations

import torch

from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from hybridserve.sampling_params import SamplingParams


def chunked_logits(runner: ModelRunner, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits, computing the chunks that end at `cuts` (ascending, last = len(ids)):
    a first chunk is a fresh prefill, later multi-token chunks prefill on cached context, one-token chunks
    take the decode path."""
    req = Request(EngineCoreRequest("parity", ids, SamplingParams(), [], 0.0), len(ids) + 1)
    table = list(range(-(-len(ids) // runner.block_size)))
    dev = runner.device
    pool = runner.state_pool
    slots = None if pool is None else [pool.allocate(req.request_id)]
    logits, start = [], 0
    try:
        with torch.inference_mode():
            for end in cuts:
                req.num_computed_tokens = start
                plan = SchedulerOutput([ScheduledRequest(req, end - start)])
                meta = runner.attention_metadata(plan, [table], slots)
                positions = torch.arange(start, end, device=dev)
                hidden = runner.model(torch.tensor(ids[start:end], device=dev), positions, runner.kv_caches, meta)
                logits.append(runner.model.compute_logits(hidden))
                start = end
    finally:
        if pool is not None:
            pool.free(req.request_id)
    return torch.cat(logits)
