"""The device's own limits and what they make a step cost: streaming read bandwidth, GEMM throughput, and a
model's weight bytes and matmul parameters. Speculative decoding sizes its drafts with them (scheduler.py);
benchmarks/limits.py measures the distance of the engine's steps from them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Roofline:
    read_gb_s: float  # streaming read bandwidth
    gemm_gflop_s: float  # square-matmul throughput in the engine's dtype


@dataclass(frozen=True)
class ModelCosts:
    read_params: int  # what a batch-1 step reads: every weight once, an input embedding one row
    matmul_params: int  # the linear layers' weights: 2 FLOPs each per token


def _best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    def run() -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    run()  # warm-up: first touch, kernel selection
    return min(run() for _ in range(repeats))


def measure(
    device: torch.device, dtype: torch.dtype, read_mib: int = 256, gemm_n: int = 1024, repeats: int = 3
) -> Roofline:
    """The best of `repeats` sums over a `read_mib` float32 tensor and of `gemm_n`-square matmuls in `dtype`, on
    `device` with the engine's threads."""
    x = torch.ones(read_mib * 2**20 // 4, dtype=torch.float32, device=device)
    read = x.numel() * x.element_size() / _best(lambda: x.sum(), device, repeats)
    a = torch.randn(gemm_n, gemm_n, device=device).to(dtype)
    b = torch.randn(gemm_n, gemm_n, device=device).to(dtype)
    gemm = 2 * gemm_n**3 / _best(lambda: torch.mm(a, b), device, repeats)
    return Roofline(read / 1e9, gemm / 1e9)


def model_costs(model: nn.Module) -> ModelCosts:
    """Counted over the parameters (a meta-device model will do). An input embedding is read a row a token,
    unless it is tied to a linear layer (the head), which reads it whole."""
    params = {id(p): p for p in model.parameters()}.values()
    matmul_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup_only = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) not in matmul_weights
    )
    read = sum(p.numel() for p in params) - lookup_only
    return ModelCosts(read, sum(p.numel() for p in params if id(p) in matmul_weights))


def weight_read_tokens(costs: ModelCosts, itemsize: int, roofline: Roofline) -> float:
    """How many tokens' matmuls take as long as reading the weights (`itemsize` bytes each) once: a step of N
    tokens costs about (this + N) tokens' compute. (For a mixture of experts it overstates the read, which
    covers only the experts a step picks.)"""
    read_s = costs.read_params * itemsize / (roofline.read_gb_s * 1e9)
    token_s = 2 * costs.matmul_params / (roofline.gemm_gflop_s * 1e9)
    return read_s / token_s
