"""Logits of our runner at every position of a sequence, computed in chunks through every attention path."""

from __future__ import annotations

import torch

from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from hybridserve.sampling_params import SamplingParams


def engine_logits(runner: ModelRunner, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """Logits at every position, computing the sequence in chunks ending at `cuts` (the last chunks of one
    token exercise the decode path, the middle ones prefill with cached context)."""
    req = Request(EngineCoreRequest("r", ids, SamplingParams(), [], 0.0), 4096)
    table = list(range(-(-len(ids) // runner.block_size)))
    logits = []
    start = 0
    with torch.inference_mode():
        for end in cuts:
            req.num_computed_tokens = start
            plan = SchedulerOutput([ScheduledRequest(req, end - start)])
            meta = runner.attention_metadata(plan, [table])
            hidden = runner.model(torch.tensor(ids[start:end]), torch.arange(start, end), runner.kv_caches, meta)
            logits.append(runner.model.compute_logits(hidden))
            start = end
    return torch.cat(logits)
