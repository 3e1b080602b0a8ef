"""The native matmul kernels (linear_f32.c, linear_blocks.c, linear_bf16.c, linear_amx.c) against float64
references, their batch invariance, and where the
runner uses them. bfloat16 runs where the CPU has AVX512-BF16: on AMX's tiles when K is a multiple of 32 and
AMX is there, else on the AVX512-BF16 register tile; the shapes below take both."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.layers.linear import NativeLinear, PackedLinear, pack_linears
from hybridserve.models.layers.moe import GatedMLP
from hybridserve.models.layers.native import (
    FusedOps,
    LinearKernels,
    load_fused_ops,
    load_linear_kernels,
    use_native_ops,
)


@pytest.fixture(scope="module")
def kernels() -> LinearKernels:
    return load_linear_kernels()


def _need(kernels: LinearKernels, dtype: torch.dtype) -> None:
    if dtype not in kernels.dtypes:
        pytest.skip(f"no native {dtype} kernel on this CPU (needs AVX512-BF16)")


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


@DTYPES
@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [
        (1, 576, 960, False),
        (6, 33, 40, True),
        (7, 5, 7, True),
        (13, 576, 49, False),
        (17, 64, 50, True),
        (64, 1536, 576, True),
        (200, 64, 33, False),
        (0, 16, 16, True),
    ],
)
def test_matches_a_float64_matmul(
    kernels: LinearKernels, dtype: torch.dtype, m: int, k: int, n: int, bias: bool
) -> None:
    _need(kernels, dtype)
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k, generator=gen).to(dtype), torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    y = kernels.linear(x, kernels.pack(w), n, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.shape == (m, n) and y.dtype == dtype
    # float32: the summation's rounding; bfloat16: float32 sums rounded once to bf16 (half an ulp, 2^-9)
    rtol, atol = (0, 8e-6 * k**0.5) if dtype == torch.float32 else (2**-8, 1e-5 * k**0.5)
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)


@DTYPES
def test_rows_may_be_strided(kernels: LinearKernels, dtype: torch.dtype) -> None:
    """A slice of a wider projection (rows apart by more than K) is read where it is; with an odd K the element
    after each row (here a NaN) is never part of a sum."""
    _need(kernels, dtype)
    gen = torch.Generator().manual_seed(1)
    for k in (64, 33):
        wide, w = torch.randn(9, 100, generator=gen).to(dtype), torch.randn(20, k, generator=gen).to(dtype)
        wide[:, 10 + k] = float("nan")
        x = wide[:, 10 : 10 + k]
        assert x.stride(0) == 100
        y = kernels.linear(x, kernels.pack(w), 20, None)
        torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=2**-8, atol=1e-4)


@DTYPES
@pytest.mark.parametrize("k", [576, 100])
def test_a_row_is_bitwise_the_same_in_any_batch(kernels: LinearKernels, dtype: torch.dtype, k: int) -> None:
    """Each output is one sum in a fixed order: alone, in a batch of 37 at any place, or in a chunk of rows
    past the kernel's 96-row blocks (bf16 with AMX: in a block of 16 with other rows or padded), a row gets
    the same bits."""
    _need(kernels, dtype)
    gen = torch.Generator().manual_seed(2)
    w, batch = torch.randn(100, k, generator=gen).to(dtype), torch.randn(230, k, generator=gen).to(dtype)
    packed = kernels.pack(w)
    together = kernels.linear(batch, packed, 100, None)
    for row in (0, 5, 36, 97, 229):
        alone = kernels.linear(batch[row : row + 1], packed, 100, None)
        assert torch.equal(alone[0], together[row])
        in_37 = kernels.linear(batch[max(0, row - 20) : max(0, row - 20) + 37], packed, 100, None)
        assert torch.equal(in_37[row - max(0, row - 20)], together[row])


@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 960), (13, 100, 49), (40, 64, 33), (65, 64, 16400)])
def test_bf16_float_out_keeps_the_sums_that_bf16_output_rounds(kernels: LinearKernels, m: int, k: int, n: int) -> None:
    """The head's float32 logits are the very sums the bf16 output rounds once, to nearest even: bitwise. The
    last shape is big enough that its logits bypass the cache (non-temporal stores, the last panel half-full
    and stored as usual); a row alone, stored as usual, gets the same bits."""
    _need(kernels, torch.bfloat16)
    gen = torch.Generator().manual_seed(k + n)
    w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    packed = kernels.pack(w)
    sums = kernels.linear(x, packed, n, b, float_out=True)
    assert sums.dtype == torch.float32 and sums.shape == (m, n)
    assert torch.equal(sums.bfloat16(), kernels.linear(x, packed, n, b))
    assert torch.equal(kernels.linear(x[-1:], packed, n, b, float_out=True)[0], sums[-1])
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(sums.double(), ref, rtol=0, atol=8e-6 * k**0.5)


def test_bad_inputs_name_what_is_wrong(kernels: LinearKernels) -> None:
    packed = kernels.pack(torch.ones(8, 16))
    with pytest.raises(ValueError, match=r"input must be torch.float32 \[M, K\].*got torch.bfloat16 \(2, 16\)"):
        kernels.linear(torch.ones(2, 16, dtype=torch.bfloat16), packed, 8, None)
    with pytest.raises(ValueError, match=r"panels \(1, 16, \d+\).*got torch.float32 \(2, 12\)"):
        kernels.linear(torch.ones(2, 12), packed, 8, None)
    with pytest.raises(ValueError, match=r"bias must be contiguous float32 \[8\], got torch.float32 \(7,\)"):
        kernels.linear(torch.ones(2, 16), packed, 8, torch.ones(7))
    with pytest.raises(
        ValueError, match=r"packing needs a 2-D CPU weight of torch.float32.*got torch.float16 \(8, 16\)"
    ):
        kernels.pack(torch.ones(8, 16, dtype=torch.float16))


@DTYPES
def test_pack_linears_swaps_every_linear_for_the_kernel(kernels: LinearKernels, dtype: torch.dtype) -> None:
    _need(kernels, dtype)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(24, 40), nn.Sequential(nn.Linear(40, 8, bias=False))).to(dtype)
    x = torch.randn(2, 3, 24).to(dtype)  # leading dimensions are kept
    expected = model[1][0](model[0](x))
    pack_linears(model, kernels)
    assert isinstance(model[0], NativeLinear) and isinstance(model[1][0], NativeLinear)
    assert not model[0].float_out
    out = model[1][0](model[0](x))
    assert out.shape == (2, 3, 8) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: nn.Linear rounds the first layer's sums alike, not its order
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_without_kernels_every_linear_is_packed_for_onednn() -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    pack_linears(model)
    assert isinstance(model[0], PackedLinear)


@DTYPES
def test_a_native_head_returns_float32_logits(kernels: LinearKernels, dtype: torch.dtype) -> None:
    _need(kernels, dtype)
    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(8, 8).to(dtype), nn.Linear(8, 50, bias=False).to(dtype)
    pack_linears(model, kernels)
    assert isinstance(model.lm_head, NativeLinear) and model.lm_head.float_out
    assert model.lm_head(torch.ones(3, 8, dtype=dtype)).dtype == torch.float32
    assert model.proj(torch.ones(3, 8, dtype=dtype)).dtype == dtype


def _blocks(kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [n, k] quantized to a GGUF block kind by the gguf package: (its blocks, the float32 weight they
    give as the GGUF loader dequantizes them). Rows of a wide range of scales, one of them with float16-subnormal
    ones."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n).unsqueeze(1)
    w[0] *= 1e-4
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(w.numpy(), qtype)
    floats = gguf.quants.dequantize(blocks, qtype).astype(np.float32)
    return torch.from_numpy(blocks), torch.from_numpy(floats.reshape(n, k))


KINDS = pytest.mark.parametrize(("kind", "share"), [("Q4_1", 0.19), ("Q8_0", 0.29), ("Q4_0", 0.19)])


@KINDS
@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [(1, 576, 960, False), (2, 64, 49, True), (7, 1536, 576, True), (8, 576, 33, False), (13, 32, 50, True),
     (100, 576, 96, True), (0, 64, 16, False)],
)  # fmt: skip
def test_block_panels_sum_bitwise_as_the_float32_weights_panels(
    kernels: LinearKernels, kind: str, share: int, m: int, k: int, n: int, bias: bool
) -> None:
    """Below 8 rows each tile dequantizes the weights it needs, from 8 each thread expands its panels: both give
    the sums of the float32 panels of the dequantized weight, bit for bit, from 19% (Q4_1) or 28% (Q8_0) of their
    bytes."""
    blocks, w = _blocks(kind, n, k, seed=m + n)
    panels = kernels.pack_blocks(w, blocks, kind)
    assert panels is not None and panels.dtype == torch.uint8
    floats = kernels.pack(w)
    assert panels.numel() < share * floats.numel() * floats.element_size()
    gen = torch.Generator().manual_seed(k)
    x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen) if bias else None
    assert torch.equal(kernels.linear(x, panels, n, b, blocks=kind), kernels.linear(x, floats, n, b))


@KINDS
def test_blocks_that_do_not_give_the_weight_are_not_used(
    kernels: LinearKernels, kind: str, share: int, caplog: pytest.LogCaptureFixture
) -> None:
    blocks, w = _blocks(kind, 40, 64, seed=1)
    changed = w.clone()
    changed[17, 33] = torch.nextafter(changed[17, 33], torch.tensor(1.0))  # one weight, one ulp
    assert kernels.pack_blocks(changed, blocks, kind) is None
    with caplog.at_level(logging.WARNING, logger="hybridserve.engine"):
        layer = NativeLinear(_linear(changed), kernels, blocks=(kind, blocks))
    assert layer.panels.dtype == torch.float32 and layer.blocks is None
    assert f"{kind} blocks of a (40, 64) weight do not give its float32 values bitwise" in caplog.text
    with pytest.raises(
        ValueError, match=rf"{kind} blocks .* got weight torch.float32 \(40, 64\), blocks torch.uint8 \(40, 20\)"
    ):
        kernels.pack_blocks(w, blocks[:, :20], kind)


def test_pack_linears_packs_float32_layers_from_their_blocks(kernels: LinearKernels) -> None:
    (b0, w0), (b1, w1) = _blocks("Q4_1", 64, 32, seed=2), _blocks("Q8_0", 16, 64, seed=3)
    model, floats = (nn.Sequential(_linear(w0), nn.Sequential(_linear(w1))) for _ in range(2))
    pack_linears(model, kernels, {"0.weight": ("Q4_1", b0), "1.0.weight": ("Q8_0", b1)})
    pack_linears(floats, kernels)
    assert (model[0].blocks, model[1][0].blocks, floats[0].blocks) == ("Q4_1", "Q8_0", None)
    x = torch.randn(3, 32)
    assert torch.equal(model(x), floats(x))


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    return layer


@pytest.fixture(scope="module")
def fused_ops() -> FusedOps:
    return load_fused_ops()


def _gated_layer(inter: int, k: int, bias: bool, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, 2 * inter, bias=bias)
    layer.weight.data.copy_(torch.randn(2 * inter, k, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(2 * inter, generator=gen))
    return layer


# rows: one tile, a tile and the two rows paired over a gate panel and its up panel (8), expanded block panels
# (from 8 rows), several tiles, float32 panels in chunks of 96 rows (100); intermediates: whole panels, and a last
# panel of 1 or 9 columns (the gate and up panels padded)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13, 32, 100])
@pytest.mark.parametrize(("inter", "k", "bias"), [(64, 96, False), (33, 64, True), (41, 32, False)])
@pytest.mark.parametrize("kind", [None, "Q4_1", "Q8_0"])
def test_a_gated_matmul_is_silu_mul_of_the_plain_one_bitwise(
    kernels: LinearKernels, fused_ops: FusedOps, m: int, inter: int, k: int, bias: bool, kind: str | None
) -> None:
    """What the MLP computes with the activation in the matmul's tiles is bit for bit what the plain matmul and
    silu_mul give, from float32 panels and from either kind of block panels."""
    if kind is None:
        layer, blocks = _gated_layer(inter, k, bias, seed=m), None
    else:
        packed_blocks, w = _blocks(kind, 2 * inter, k, seed=m)
        layer, blocks = _linear(w), (kind, packed_blocks)
    plain = NativeLinear(layer, kernels, blocks=blocks)
    gated = NativeLinear(layer, kernels, blocks=blocks, gated=True)
    assert (gated.out_features, gated.blocks, gated.weight_numel) == (inter, kind, plain.weight_numel)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(inter))
    want = fused_ops.silu_mul(plain(x))
    assert torch.equal(gated(x), want)
    assert torch.equal(gated(x[:1]), want[:1])  # batch invariant too


def test_pack_linears_gates_the_projections_a_module_names(kernels: LinearKernels, fused_ops: FusedOps) -> None:
    mlp = GatedMLP(32, 40)
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(6, 32)
    reference = mlp.down_proj(F.silu(mlp.gate_up_proj(x)[:, :40]) * mlp.gate_up_proj(x)[:, 40:])
    pack_linears(mlp, kernels)
    use_native_ops(mlp, fused_ops)
    assert mlp.gate_up_proj.gated and not mlp.down_proj.gated
    torch.testing.assert_close(mlp(x), reference, rtol=1e-5, atol=1e-5)
    unpacked = nn.Sequential(_linear(torch.randn(80, 32)))  # no gated_projections: a plain matmul
    pack_linears(unpacked, kernels)
    assert not unpacked[0].gated and unpacked(x).shape == (6, 80)


def test_a_gated_matmul_names_what_it_cannot_take(kernels: LinearKernels) -> None:
    gated = NativeLinear(_gated_layer(40, 32, True, seed=0), kernels, gated=True)
    # the gate's 40 columns and the up's, each padded to whole panels of the host's width (16 with AVX2, 32 with
    # AVX-512)
    width = kernels.panel_width[torch.float32]
    panels = 2 * -(-40 // width)
    assert gated.panels.shape[0] == panels
    with pytest.raises(
        ValueError, match=rf"bias must be contiguous float32 \[{panels * width}\], got torch.float32 \(80,\)"
    ):
        kernels.linear(torch.randn(2, 32), gated.panels, 40, torch.zeros(80), gated=True)
    with pytest.raises(
        ValueError, match=rf"a gated matmul takes float32 panels of pack_gated's .* \({panels} panels for 40"
    ):
        kernels.linear(torch.randn(2, 32), gated.panels[:-1], 40, None, gated=True)
    with pytest.raises(ValueError, match=r"a gated weight has \[gate; up\] rows, an even count; got \(5, 3\)"):
        kernels.pack_gated(torch.zeros(5, 3))
    if torch.bfloat16 in kernels.dtypes:
        with pytest.raises(ValueError, match="a gated native matmul is float32, got a torch.bfloat16 weight"):
            NativeLinear(_gated_layer(40, 32, False, seed=0).to(torch.bfloat16), kernels, gated=True)


@pytest.mark.parametrize("threads", [1, 3, 7])
def test_any_team_of_threads_computes_every_panel_once_to_the_same_bits(kernels: LinearKernels, threads: int) -> None:
    """Each thread takes its own share of the panels (in float32, pairs of them) and then what the others' shares
    have left, so a preempted thread holds up a matmul by one item. However the items fall (one thread; more
    threads than cores, preempted all the time), every output is the default team's bits: no item skipped or left
    stale, none summed differently. Two inputs take turns, so an item left out would keep the other input's sums."""
    q4_1, w4 = _blocks("Q4_1", 960, 576, seed=1)
    q8_0, w8 = _blocks("Q8_0", 2 * 160, 576, seed=2)
    cases = [  # float32 panels in 3 chunks of rows (more shares than the stack holds), block panels dequantized
        # in the tiles (3 rows) and expanded (64), a gated matmul from blocks
        (NativeLinear(_linear(torch.randn(600, 64)), kernels), 200),
        (NativeLinear(_linear(w4), kernels, blocks=("Q4_1", q4_1)), 3),
        (NativeLinear(_linear(w4), kernels, blocks=("Q4_1", q4_1)), 64),
        (NativeLinear(_linear(w8), kernels, blocks=("Q8_0", q8_0), gated=True), 33),
    ]
    if torch.bfloat16 in kernels.dtypes:  # bf16 panels in 3 chunks of rows, on AMX's tiles too where it is
        cases += [(NativeLinear(_linear(torch.randn(600, k)).to(torch.bfloat16), kernels), 200) for k in (64, 40)]
    dtypes = [torch.bfloat16 if layer.panels.dtype == torch.bfloat16 else torch.float32 for layer, _ in cases]
    gen = torch.Generator().manual_seed(3)
    inputs = [
        [torch.randn(rows, layer.in_features, generator=gen).to(dtype) for _ in range(2)]
        for (layer, rows), dtype in zip(cases, dtypes, strict=True)
    ]
    want = [[layer(x) for x in xs] for (layer, _), xs in zip(cases, inputs, strict=True)]
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(10):
            for (layer, _), xs, ys in zip(cases, inputs, want, strict=True):
                for x, y in zip(xs, ys, strict=True):
                    assert torch.equal(layer(x), y)
    finally:
        torch.set_num_threads(default)
