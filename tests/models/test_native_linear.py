"""The native float32 matmul kernel (linear.c) against float64 references, its batch invariance, and where the
runner uses it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridserve.models.layers.linear import NativeLinear, PackedLinear, pack_linears
from hybridserve.models.layers.native import LinearKernels, load_linear_kernels


@pytest.fixture(scope="module")
def kernels() -> LinearKernels:
    return load_linear_kernels()


@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [
        (1, 576, 960, False),
        (6, 33, 40, True),
        (7, 5, 7, True),
        (13, 576, 49, False),
        (64, 1536, 576, True),
        (200, 64, 33, False),
        (0, 16, 16, True),
    ],
)
def test_matches_a_float64_matmul(kernels: LinearKernels, m: int, k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = kernels.linear(x, kernels.pack(w), n, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-6 * k**0.5 * 4)


def test_rows_may_be_strided(kernels: LinearKernels) -> None:
    """A slice of a wider projection (rows apart by more than K) is read where it is."""
    gen = torch.Generator().manual_seed(1)
    wide, w = torch.randn(9, 100, generator=gen), torch.randn(20, 64, generator=gen)
    x = wide[:, 10:74]
    assert x.stride(0) == 100
    torch.testing.assert_close(kernels.linear(x, kernels.pack(w), 20, None), x @ w.T, rtol=1e-6, atol=1e-5)


def test_a_row_is_bitwise_the_same_in_any_batch(kernels: LinearKernels) -> None:
    """Each output is one sum in a fixed order: alone, in a batch of 37 at any place, or in a chunk of rows
    past the kernel's 96-row blocks, a row gets the same bits."""
    gen = torch.Generator().manual_seed(2)
    w, batch = torch.randn(100, 576, generator=gen), torch.randn(230, 576, generator=gen)
    packed = kernels.pack(w)
    together = kernels.linear(batch, packed, 100, None)
    for row in (0, 5, 36, 97, 229):
        alone = kernels.linear(batch[row : row + 1], packed, 100, None)
        assert torch.equal(alone[0], together[row])
        in_37 = kernels.linear(batch[max(0, row - 20) : max(0, row - 20) + 37], packed, 100, None)
        assert torch.equal(in_37[row - max(0, row - 20)], together[row])


def test_bad_inputs_name_what_is_wrong(kernels: LinearKernels) -> None:
    packed = kernels.pack(torch.ones(8, 16))
    with pytest.raises(ValueError, match=r"input must be float32 \[M, 16\].*torch.bfloat16 \(2, 16\)"):
        kernels.linear(torch.ones(2, 16, dtype=torch.bfloat16), packed, 8, None)
    with pytest.raises(ValueError, match=r"input must be float32 \[M, 16\].*\(2, 12\)"):
        kernels.linear(torch.ones(2, 12), packed, 8, None)
    with pytest.raises(ValueError, match=r"packing needs a 2-D float32 CPU weight, got torch.float16 \(8, 16\)"):
        kernels.pack(torch.ones(8, 16, dtype=torch.float16))


def test_pack_linears_swaps_every_float32_linear_for_the_kernel(kernels: LinearKernels) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(24, 40), nn.Sequential(nn.Linear(40, 8, bias=False)))
    x = torch.randn(2, 3, 24)  # leading dimensions are kept
    expected = model[1][0](model[0](x))
    pack_linears(model, kernels)
    assert isinstance(model[0], NativeLinear) and isinstance(model[1][0], NativeLinear)
    out = model[1][0](model[0](x))
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_without_kernels_every_linear_is_packed_for_onednn() -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    pack_linears(model)
    assert isinstance(model[0], PackedLinear)
