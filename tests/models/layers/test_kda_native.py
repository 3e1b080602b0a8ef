"""The native KDA decode step against kda_recurrent, and how the model runner hands it and the fused ops to
Kimi-Linear's layers or falls back."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve.config import EngineConfig
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.models.layers.kda import kda_recurrent, l2norm
from hybridserve.models.layers.native import load_kda_decode

NUM_SLOTS = 40


def _step_inputs(b: int, h: int, d: int, decay_scale: float, gen: torch.Generator):
    """q, k, v as the runner hands them over: q and k normalised, v a strided view of the convolution's
    output [B, 3 * H * d]."""
    mixed = torch.randn(b, 3, h, d, generator=gen).view(b, 3 * h * d)
    q, k, v = mixed.view(b, 3, h, d).unbind(1)
    g = -torch.rand(b, h, d, generator=gen) * decay_scale
    return l2norm(q) * d**-0.5, l2norm(k), v, g, torch.rand(b, h, generator=gen)


@pytest.mark.parametrize(("b", "h", "d"), [(1, 1, 8), (5, 3, 64), (9, 4, 64), (3, 2, 128), (33, 4, 64)])
@pytest.mark.parametrize("decay_scale", [0.05, 40.0])  # weak decay, and decay strong enough to underflow
def test_kernel_matches_kda_recurrent_over_steps_on_scattered_slots(b, h, d, decay_scale):
    """(9, 4, 64) and (33, 4, 64) are past the kernel's threshold for threads."""
    gen = torch.Generator().manual_seed(b * 1000 + h * 10 + d)
    pool = torch.randn(NUM_SLOTS, h, d, d, generator=gen)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:b]
    want_pool = pool.clone()
    kernel = load_kda_decode(d)
    for _ in range(3):
        q, k, v, g, beta = _step_inputs(b, h, d, decay_scale, gen)
        assert v.stride(0) == 3 * h * d  # the kernel reads the strided view as it is
        st = want_pool.index_select(0, slots)
        want = kda_recurrent(q, k, v, g, beta, st)
        want_pool.index_copy_(0, slots, st)
        got = kernel.decode(q, k, v, g, beta, pool, slots)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(pool, want_pool, atol=2e-6, rtol=1e-5)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool).index_fill_(0, slots, False)
    assert torch.equal(pool[untouched], want_pool[untouched])


def test_a_slot_outside_the_pool_is_named_and_nothing_changes():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = _step_inputs(2, 2, 8, 1.0, gen)
    pool = torch.randn(4, 2, 8, 8, generator=gen)
    before = pool.clone()
    with pytest.raises(ValueError, match=r"state slot 4 \(row 1\) is outside the pool's 4"):
        load_kda_decode(8).decode(q, k, v, g, beta, pool, torch.tensor([0, 4]))
    assert torch.equal(pool, before)


def test_shapes_the_kernel_was_not_built_for_are_refused():
    q, k, v, g, beta = _step_inputs(2, 2, 8, 1.0, torch.Generator().manual_seed(0))
    pool = torch.zeros(4, 2, 8, 8)
    with pytest.raises(ValueError, match=r"kernel built for head_dim 16; got q \(2, 2, 8\)"):
        load_kda_decode(16).decode(q, k, v, g, beta, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"states must be contiguous and slots int64 on CPU, got .* torch.int32"):
        load_kda_decode(8).decode(q, k, v, g, beta, pool, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"q must be float32 on CPU, got torch.bfloat16 on cpu"):
        load_kda_decode(8).decode(q.bfloat16(), k, v, g, beta, pool, torch.tensor([0, 1]))


def test_runner_uses_the_kernel_on_cpu_and_falls_back_without_a_compiler(
    kimi_linear_dir, monkeypatch, tmp_path, caplog
):
    def runner(**kwargs: object) -> ModelRunner:
        config = EngineConfig.of(
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=8,
            num_state_slots=1,
            **kwargs,
            kv_cache_prefault=False,
        )
        return ModelRunner(config, kimi_linear_dir)

    def fused(r: ModelRunner) -> set[str]:
        return {type(m).__name__ for m in r.model.modules() if getattr(m, "native", None) is not None}

    native = runner()
    assert native.backend.state_kernel is not None
    assert fused(native) == {"RMSNorm", "GatedMLP", "Experts"}  # the tiny checkpoint has dense and MoE layers
    off = runner(native_kernels=False)
    assert off.backend.state_kernel is None and fused(off) == set()
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    with caplog.at_level(logging.WARNING, logger="hybridserve.engine"):
        fallback = runner()
    assert fallback.backend.state_kernel is None and fused(fallback) == set()
    assert "KDA decode falls back to PyTorch ops: C compiler 'no-such-cc'" in caplog.text
