"""The native CPU kernels against references computed with PyTorch, and their fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from hybridserve.config import EngineConfig
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.models.layers import native
from hybridserve.models.layers.attention import AttentionMetadata, rope_and_cache
from hybridserve.models.layers.native import (
    KernelUnavailable,
    load_fused_ops,
    load_linear_kernels,
    load_paged_attention,
    max_isa,
)
from hybridserve.models.layers.norm import RMSNorm
from hybridserve.models.layers.rope import RotaryEmbedding


def _reference(q, cache, tables, lens, scale):
    """Plain float64 attention of each request's query over its first `len` cached tokens."""
    b, hq, d = q.shape
    hkv, bs = cache.shape[1], cache.shape[3]
    group = hq // hkv
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)]
        k = cache[0][:, blocks].reshape(hkv, -1, d)[:, :n].double()
        v = cache[1][:, blocks].reshape(hkv, -1, d)[:, :n].double()
        for h in range(hq):
            scores = (q[i, h].double() @ k[h // group].T) * scale
            out[i, h] = scores.softmax(-1) @ v[h // group]
    return out


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 64, 32), (6, 2, 80, 8)],
)
@pytest.mark.parametrize(
    ("dtype", "portable"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_kernel_matches_float64_reference(q_heads, kv_heads, head_dim, block_size, dtype, portable):
    gen = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks = 64
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    # Lengths on and around block boundaries; block tables in scrambled order, with two requests sharing
    # their first blocks as prefix-cache hits do.
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size, 2])
    width = 5
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).contiguous()
    tables[4, :2] = tables[3, :2]
    # Queries as the model hands them over: the head rows of a wider projection, strided between tokens.
    qkv = torch.randn(len(lens), q_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q = qkv[:, :q_heads]
    kernel = load_paged_attention(dtype, head_dim, block_size, q_heads // kv_heads, portable=portable)
    assert not (portable and kernel.bf16_dot)
    out = kernel.decode(q, cache, tables, lens, head_dim**-0.5)
    ref = _reference(q, cache, tables, lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == (len(lens), q_heads, head_dim)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    else:  # accumulated in float32, rounded once: within one bfloat16 step of the exact result
        torch.testing.assert_close(out.double(), ref.to(dtype).double(), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write_match_the_pytorch_path(dtype):
    """The fused rotary + cache write leaves the same queries, keys, values and cache as the stock ops."""
    config = PretrainedConfig(max_position_embeddings=512, rope_theta=10000.0)
    rope = RotaryEmbedding(config, 64)
    rope.to(dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    tokens, q_heads, kv_heads, num_blocks = 70, 9, 3, 12  # 70 tokens: past the kernel's threshold for threads
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, 64, generator=gen).to(dtype)
    cos_sin = rope.cos_sin(torch.randint(0, 512, (tokens,), generator=gen))
    slots = torch.randperm(num_blocks * 16, generator=gen)[:tokens]
    results = []
    for kernels in (None, load_paged_attention(dtype, 64, 16, 3)):
        cache = torch.zeros(2, kv_heads, num_blocks, 16, 64, dtype=dtype)
        meta = AttentionMetadata(slots, None, [], kernels=kernels)
        q, k, v = rope_and_cache(qkv.clone(), q_heads, cos_sin, cache, meta)
        results.append((q, k, v, cache))
    for want, got in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, **_one_ulp(dtype))
    assert torch.equal(results[1][3].view(2, kv_heads, -1, 64)[1][:, slots].transpose(0, 1), qkv[:, q_heads + 3 :])


def _bf16_edge_cases(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Normal values over a wide range, with zeros, infinities, NaNs of both signs and denormals mixed in."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen) * torch.pow(10.0, torch.randint(-38, 30, (rows, dim), generator=gen))
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 3e-39, -1e-40])
    spots = torch.rand(rows, dim, generator=gen) < 0.05
    x[spots] = specials[torch.randint(0, len(specials), (int(spots.sum()),), generator=gen)]
    return x.bfloat16()


@pytest.mark.parametrize("tokens", [1, 70])
def test_bf16_rope_and_cache_write_are_bitwise_their_portable_c(tokens):
    """The AVX512-BF16 rotary leaves every bit of the queries, keys, values and cache as the plain C does, on
    values over bf16's whole range, infinities, NaNs and denormals included."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = _bf16_edge_cases(tokens, 15 * 64, 7).view(tokens, 15, 64)
    angles = torch.rand(tokens, 32, generator=gen) * 500
    cos, sin = torch.cat([angles.cos()] * 2, 1).bfloat16(), torch.cat([-angles.sin(), angles.sin()], 1).bfloat16()
    slots = torch.randperm(12 * 16, generator=gen)[:tokens]
    results = []
    for portable in (False, True):
        cache = torch.zeros(2, 3, 12, 16, 64, dtype=torch.bfloat16)
        rotated = qkv.clone()
        load_paged_attention(torch.bfloat16, 64, 16, 3, portable=portable).rope_write_kv(
            rotated, 9, (cos.unsqueeze(1), sin.unsqueeze(1)), cache, slots
        )
        results.append((rotated.view(torch.int16), cache.view(torch.int16)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize(
    ("dtype", "portable"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
@pytest.mark.parametrize("length", [1, 17, 30])
def test_stale_rows_past_a_requests_length_never_reach_its_output(dtype, portable, length):
    """The rows of its last block past a request's length hold whatever an earlier request left, NaN included."""
    gen = torch.Generator().manual_seed(length)
    cache = torch.randn(2, 3, 4, 16, 64, generator=gen).to(dtype)
    table = torch.tensor([[3, 1]])
    cache[:, :, 3 if length < 16 else 1, length % 16 :] = float("nan")
    q = torch.randn(1, 9, 64, generator=gen).to(dtype)
    kernel = load_paged_attention(dtype, 64, 16, 3, portable=portable)
    out = kernel.decode(q, cache, table, torch.tensor([length]), 0.125)
    ref = _reference(q, cache, table, torch.tensor([length]), 0.125)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), atol=1e-2, rtol=8e-3)


def test_a_single_visible_key_returns_its_value():
    cache = torch.zeros(2, 1, 4, 16, 64)
    cache[1, 0, 2, 0] = torch.arange(64.0)
    out = load_paged_attention(torch.float32, 64, 16, 1).decode(
        torch.randn(1, 1, 64), cache, torch.tensor([[2]]), torch.tensor([1]), 0.125
    )
    assert torch.equal(out[0, 0], torch.arange(64.0))


def test_bf16_dot_product_path_is_used_where_the_build_has_it():
    """Where the kernels are built for AVX512-BF16 (the host's level, or $HYBRIDSERVE_MAX_CPU_ISA's below it), as the
    matmul library's bf16 panels say."""
    has_bf16 = max_isa() in ("avx512_bf16", "amx")
    assert (torch.bfloat16 in load_linear_kernels().dtypes) == has_bf16
    assert load_paged_attention(torch.bfloat16, 64, 16, 3).bf16_dot == has_bf16
    assert not load_paged_attention(torch.float32, 64, 16, 3).bf16_dot
    assert not load_paged_attention(torch.bfloat16, 80, 16, 3).bf16_dot  # 80 is not a multiple of 32


def _prefill_reference(q, cache, table, context_len):
    """float64 causal attention of a chunk's queries (positions context_len ...) over the request's cached keys."""
    n, hq, d = q.shape
    hkv = cache.shape[1]
    length = context_len + n
    k = cache[0][:, table].reshape(hkv, -1, d)[:, :length].double().repeat_interleave(hq // hkv, 0)
    v = cache[1][:, table].reshape(hkv, -1, d)[:, :length].double().repeat_interleave(hq // hkv, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * d**-0.5  # [Hq, n, length]
    visible = torch.arange(length).unsqueeze(0) <= (context_len + torch.arange(n)).unsqueeze(1)
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def prefill_kernel(request: pytest.FixtureRequest) -> native.PagedAttention:
    """The default model's attention kernels, where they prefill natively (bf16: its dot products; float32: any
    CPU, 16-token blocks)."""
    kernel = load_paged_attention(request.param, 64, 16, 3)
    if not kernel.prefills:
        pytest.skip("native bf16 prefill needs AVX512-BF16")
    return kernel


@pytest.mark.parametrize(
    ("context_len", "n"), [(0, 1), (0, 5), (0, 16), (0, 17), (0, 200), (7, 9), (16, 40), (33, 70), (100, 1)]
)
def test_prefill_matches_float64_reference(prefill_kernel, context_len, n):
    """Chunks from the start and after a prefix, on and around block boundaries, scattered blocks, queries
    strided as the model hands them over: within a step of the dtype of exact causal attention."""
    dtype = prefill_kernel.dtype
    gen = torch.Generator().manual_seed(context_len * 1000 + n)
    cache = torch.randn(2, 3, 64, 16, 64, generator=gen).to(dtype)
    table = torch.randperm(64, generator=gen)[: -(-(context_len + n) // 16)].contiguous()
    qkv = torch.randn(n, 9 + 6, 64, generator=gen).to(dtype)
    out = prefill_kernel.prefill(qkv[:, :9], cache, table, context_len, 64**-0.5)
    ref = _prefill_reference(qkv[:, :9], cache, table, context_len)
    assert out.dtype == dtype and out.shape == (n, 9, 64)
    tol = 1.5e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), atol=tol, rtol=tol)


def test_prefill_in_chunks_equals_the_whole_prefill_bit_for_bit(prefill_kernel):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 3, 32, 16, 64, generator=gen).to(prefill_kernel.dtype)
    table = torch.randperm(32, generator=gen)[:19].contiguous()
    q = torch.randn(300, 9, 64, generator=gen).to(prefill_kernel.dtype)
    whole = prefill_kernel.prefill(q, cache, table, 0, 0.125)
    chunks = [
        prefill_kernel.prefill(q[a:b], cache, table, a, 0.125) for a, b in ((0, 37), (37, 160), (160, 299), (299, 300))
    ]
    assert torch.equal(torch.cat(chunks), whole)


def test_prefill_ignores_what_the_cache_holds_past_the_context(prefill_kernel):
    """Stale keys and values past the request's tokens (another request's, or NaN) never reach its outputs."""
    dtype = prefill_kernel.dtype
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(2, 3, 4, 16, 64, generator=gen).to(dtype)
    q = torch.randn(21, 9, 64, generator=gen).to(dtype)
    table = torch.tensor([2, 0])
    clean = prefill_kernel.prefill(q, cache, table, 0, 0.125)
    cache[:, :, 0, 5:] = float("nan")  # the second block's positions 21.. are past the 21 tokens
    assert torch.equal(prefill_kernel.prefill(q, cache, table, 0, 0.125), clean)
    assert not clean.isnan().any()


def test_prefill_refuses_a_block_table_too_short(prefill_kernel):
    dtype = prefill_kernel.dtype
    cache = torch.zeros(2, 3, 4, 16, 64, dtype=dtype)
    with pytest.raises(ValueError, match=r"block table of 2 blocks cannot hold 20 \+ 13 tokens of a prefill"):
        prefill_kernel.prefill(torch.zeros(13, 9, 64, dtype=dtype), cache, torch.tensor([0, 1]), 20, 0.125)


def test_native_prefill_with_16_token_blocks_in_float32_and_with_bf16_dot_products_in_bf16():
    assert load_paged_attention(torch.float32, 64, 16, 3).prefills
    assert not load_paged_attention(torch.float32, 64, 32, 3).prefills
    assert not load_paged_attention(torch.bfloat16, 64, 16, 3, portable=True).prefills
    assert not load_paged_attention(torch.bfloat16, 64, 32, 3).prefills
    assert (
        load_paged_attention(torch.bfloat16, 64, 16, 3).prefills
        == load_paged_attention(torch.bfloat16, 64, 16, 3).bf16_dot
    )


def test_shapes_it_was_not_built_for_are_refused():
    kernel = load_paged_attention(torch.float32, 64, 16, 3)
    with pytest.raises(ValueError, match=r"kernel built for head_dim 64, block_size 16, 3 query heads per KV head"):
        kernel.decode(
            torch.randn(1, 4, 64), torch.zeros(2, 1, 4, 16, 64), torch.tensor([[0]]), torch.tensor([1]), 0.125
        )


def test_no_kernel_for_float16():
    with pytest.raises(KernelUnavailable, match=r"no native paged-attention kernels for dtype torch.float16"):
        load_paged_attention(torch.float16, 64, 16, 1)


def test_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(KernelUnavailable, match=r"C compiler 'no-such-cc' \(from \$CC, default cc\) not found"):
        load_paged_attention(torch.float32, 64, 16, 1)


def test_failed_build_leaves_no_library(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # runs, prints nothing, exits 1
    with pytest.raises(KernelUnavailable, match=r"false failed to build paged_attention \(paged_decode_bf16.c"):
        load_paged_attention(torch.float32, 64, 16, 1)
    assert list((tmp_path / "kernels").iterdir()) == []


def test_build_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(tmp_path))
    defines = {"HEAD_DIM": 64, "BLOCK_SIZE": 16, "GROUP": 1}
    first = native._build("paged_attention", defines)
    mtime = first.stat().st_mtime_ns
    assert native._build("paged_attention", defines) == first and first.stat().st_mtime_ns == mtime
    assert first.name.startswith("paged_attention-head_dim64-block_size16-group1-")
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]


def test_runner_uses_the_kernel_on_cpu_and_falls_back_without_a_compiler(smollm2_dir, monkeypatch, tmp_path, caplog):
    native = ModelRunner(
        EngineConfig.of(dtype="float32", device="cpu", num_kv_blocks=8, kv_cache_prefault=False), smollm2_dir
    )
    assert native.backend.attention and native.backend.fused_ops
    assert native.sampler.native is native.backend.fused_ops
    config = EngineConfig.of(
        dtype="float32", device="cpu", num_kv_blocks=8, native_kernels=False, kv_cache_prefault=False
    )
    stock = ModelRunner(config, smollm2_dir)
    assert stock.backend.attention is None and stock.sampler.native is None
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    with caplog.at_level(logging.WARNING, logger="hybridserve.engine"):
        runner = ModelRunner(
            EngineConfig.of(dtype="float32", device="cpu", num_kv_blocks=8, kv_cache_prefault=False), smollm2_dir
        )
    assert runner.backend.attention is None and runner.sampler.native is None
    assert runner.model.model.norm.native is None and runner.model.model.layers[0].mlp.native is None
    assert "paged attention falls back to PyTorch ops: C compiler 'no-such-cc'" in caplog.text
    assert "element-wise ops stay PyTorch ops: C compiler 'no-such-cc'" in caplog.text


def _one_ulp(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances of about one rounding step of `dtype` (the kernels sum in a different order)."""
    return {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 is past the kernel's threshold for threads
def test_add_rms_norm_matches_the_pytorch_path(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    x, residual = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
    with torch.no_grad():
        want_h, want_stream = norm(x, residual.clone())
        want_first, _ = norm(residual.clone())
        norm.native = load_fused_ops()
        stream = residual.clone()
        got_h, got_stream = norm(x, stream)
        got_first, _ = norm(residual.clone())
    assert got_stream is stream  # updated in place
    assert torch.equal(got_stream, want_stream)  # one rounding of the same sum
    torch.testing.assert_close(got_h, want_h, **_one_ulp(dtype))
    torch.testing.assert_close(got_first, want_first, **_one_ulp(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_pytorch(dtype):
    gate_up = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(load_fused_ops().silu_mul(gate_up), F.silu(gate) * up, **_one_ulp(dtype))


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 7), (9, 1536), (64, 100)])
def test_bf16_fused_ops_are_bitwise_their_portable_c(rows, dim):
    """The AVX512-BF16 loops round in one instruction where plain C takes a dozen integer steps; denormals (which
    the instruction flushes) and NaNs (whose sign it keeps) take the integer steps too: every bit agrees."""
    native, portable = load_fused_ops(), load_fused_ops(portable=True)
    gate_up, x, delta = (_bf16_edge_cases(rows, w, seed) for seed, w in enumerate((2 * dim, dim, dim)))
    x[0] = torch.tensor([1e-39, -2e-39] * dim)[:dim].bfloat16()  # a row whose norm makes denormals
    weight = _bf16_edge_cases(1, dim, 3)[0]
    bits = [ops.silu_mul(gate_up).view(torch.int16) for ops in (native, portable)]
    assert torch.equal(*bits)
    for d in (delta, None):
        outs = []
        for ops in (native, portable):
            stream = x.clone()
            outs.append((ops.add_rms_norm(stream, d, weight, 1e-5).view(torch.int16), stream.view(torch.int16)))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equals_torch_argmax_ties_nans_and_strides_included(dtype):
    """The greedy pick: exactly torch.argmax, on logits wide enough for threads and on a strided slice (the
    sampler drops a padded head's columns), with ties (the first wins), a NaN (it wins), a row of -inf (0)."""
    ops = load_fused_ops()
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(64, 49160, generator=gen).to(dtype)
    logits = wide[:, :49152]
    logits[3, 17] = logits[3, 4000] = 50.0  # a tie
    logits[5, 9] = float("nan")
    logits[5, 30] = float("nan")
    logits[6] = float("-inf")
    logits[7, -1] = 99.0  # the last column
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    assert ops.argmax(logits)[[3, 5, 6, 7]].tolist() == [17, 9, 0, 49151]
    with pytest.raises(ValueError, match=r"argmax needs CPU bfloat16 or float32 rows, got torch.float16"):
        ops.argmax(logits.half())
