"""What a step costs on this device: the weights a step reads, its matmul parameters, and the measured limits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridserve.engine import roofline


class _Tiny(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4, bias=True)
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize(
    ("tied", "read", "matmul"),
    [
        (False, 16 + 4 + 40, 16 + 40),  # the embedding is looked up a row a token: not read whole
        (True, 40 + 16 + 4, 16 + 40),  # tied to the head, which reads it whole; counted once
    ],
)
def test_model_costs_count_what_a_step_reads_and_multiplies(tied, read, matmul):
    assert roofline.model_costs(_Tiny(tied)) == roofline.ModelCosts(read, matmul)


def test_weight_read_tokens_is_the_read_time_over_one_token_s_matmuls():
    costs = roofline.ModelCosts(read_params=100, matmul_params=50)
    limits = roofline.Roofline(read_gb_s=1.0, gemm_gflop_s=10.0)
    # 200 bytes at 1 GB/s against 100 FLOPs a token at 10 GFLOP/s
    assert roofline.weight_read_tokens(costs, 2, limits) == pytest.approx(20.0)


def test_measure_reports_positive_limits():
    limits = roofline.measure(torch.device("cpu"), torch.float32, read_mib=8, gemm_n=128, repeats=1)
    assert limits.read_gb_s > 0 and limits.gemm_gflop_s > 0
