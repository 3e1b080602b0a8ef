"""The math of Kimi Linear / K3 pieces: KDA's two forms, the K3 switches, the router."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.config import EngineConfig
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.parity import chunked_logits
from hybridserve.models.layers.depth_mix import DepthMix, DepthStream
from hybridserve.models.layers.kda import KDAConfig, KimiDeltaAttention, kda_chunked, kda_recurrent, l2norm
from hybridserve.models.layers.mla import MLAConfig, MultiheadLatentAttention
from hybridserve.models.layers.moe import MoEConfig, Router


def _kda_inputs(h: int, t: int, d: int, decay_scale: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(h, t, d, generator=gen)) * d**-0.5
    k = l2norm(torch.randn(h, t, d, generator=gen))
    v = torch.randn(h, t, d, generator=gen)
    g = -torch.rand(h, t, d, generator=gen) * decay_scale
    beta = torch.rand(h, t, generator=gen)
    return q, k, v, g, beta, torch.randn(h, d, d, generator=gen)


@pytest.mark.parametrize("t", [1, 15, 16, 17, 50])
@pytest.mark.parametrize("decay_scale", [0.05, 40.0])  # weak decay, and decay strong enough to underflow
def test_chunked_form_equals_recurrent_form(t, decay_scale):
    q, k, v, g, beta, s0 = _kda_inputs(3, t, 8, decay_scale)
    s_chunked = s0.clone()
    o_chunked = kda_chunked(q, k, v, g, beta, s_chunked)
    s_rec = s0.clone().unsqueeze(0)
    o_rec = torch.stack(
        [
            kda_recurrent(q[None, :, i], k[None, :, i], v[None, :, i], g[None, :, i], beta[None, :, i], s_rec)[0]
            for i in range(t)
        ],
        1,
    )
    assert torch.isfinite(o_chunked).all()
    assert (o_chunked - o_rec).abs().max().item() < 1e-5
    assert (s_chunked - s_rec[0]).abs().max().item() < 1e-5


def test_recurrent_step_is_the_delta_rule():
    q, k, v, g, beta, s0 = _kda_inputs(1, 1, 4, 1.0)
    s = s0.clone().unsqueeze(0)
    o = kda_recurrent(q[:, 0][None], k[:, 0][None], v[:, 0][None], g[:, 0][None], beta[:, 0][None], s)
    decayed = torch.diag(g[0, 0].exp()) @ s0[0]
    expected = decayed + beta[0, 0] * torch.outer(k[0, 0], v[0, 0] - decayed.T @ k[0, 0])
    assert torch.allclose(s[0, 0], expected, atol=1e-6)
    assert torch.allclose(o[0, 0], expected.T @ q[0, 0], atol=1e-6)


def _kda(lower_bound: float | None) -> KimiDeltaAttention:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(KDAConfig(32, 2, 8, 4, 1e-5, lower_bound))
    with torch.no_grad():
        layer.A_log.uniform_(0.0, 2.5)
        layer.dt_bias.normal_()
    return layer


def test_lower_bounded_gate():
    """K3: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), always within [lower_bound, 0]."""
    layer = _kda(-5.0)
    f = torch.randn(6, 16) * 30
    x = (f + layer.dt_bias).view(6, 2, 8)
    expected = -5.0 * torch.sigmoid(layer.A_log.exp().view(2, 1) * x)
    assert torch.allclose(layer.decay(f), expected)
    assert layer.decay(f).min() >= -5.0 and layer.decay(f).max() <= 0.0
    unbounded = _kda(None)
    assert torch.allclose(unbounded.decay(f), -unbounded.A_log.exp().view(2, 1) * F.softplus(x))
    assert unbounded.decay(f).min() < -5.0  # the softplus form is not bounded


def test_depth_mix_with_a_zero_query_is_the_mean():
    values = torch.randn(4, 3, 16)
    mix = DepthMix(16, 1e-5)  # zero-initialised query
    assert torch.allclose(mix(values), values.mean(0), atol=1e-6)


def test_depth_mix_is_softmax_over_normalised_keys():
    values = torch.randn(5, 3, 16) * torch.tensor([1.0, 5.0, 0.1, 2.0, 1.0]).view(5, 1, 1)
    mix = DepthMix(16, 1e-5)
    with torch.no_grad():
        mix.proj.normal_()
        mix.norm.uniform_(0.5, 1.5)
    keys = values / values.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * mix.norm
    weights = (keys @ mix.proj[0]).softmax(0)
    assert torch.allclose(mix(values), (weights.unsqueeze(-1) * values).sum(0), atol=1e-5)


def test_depth_stream_blocks():
    emb = torch.randn(2, 4)
    stream = DepthStream(emb)
    assert torch.equal(stream.values(), emb[None])  # the first sublayer sees only the embedding
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    stream.add(a)
    stream.add(b)
    assert torch.equal(stream.values(), torch.stack([emb, a + b]))  # sealed blocks + the running sum
    stream.seal()
    assert torch.equal(stream.values(), torch.stack([emb, a + b]))
    stream.add(a)
    assert torch.equal(stream.values(), torch.stack([emb, a + b, a]))


def _mla(output_gate: bool) -> MultiheadLatentAttention:
    torch.manual_seed(0)
    layer = MultiheadLatentAttention(MLAConfig(32, 2, None, 16, 8, 4, 8, 1e-5, output_gate))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def test_mla_output_gate_scales_by_sigmoid_of_the_input():
    """K3: o_proj(attention * sigmoid(g_proj(x))); with a zero g_proj the gate is exactly one half."""
    from hybridserve.models.layers.attention import AttentionMetadata, PrefillChunk

    gated, plain = _mla(True), _mla(False)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("g_proj")})
    x = torch.randn(5, 32)

    def run(layer):
        cache = torch.zeros(4, 4, layer.latent_dim)
        meta = AttentionMetadata(torch.arange(5), None, [PrefillChunk(0, 5, 0, None, None)])
        return layer(x, cache, meta)

    with torch.no_grad():
        gated.g_proj.weight.zero_()
        assert torch.allclose(run(gated), 0.5 * run(plain), atol=1e-6)
        gated.g_proj.weight.normal_()
        assert not torch.allclose(run(gated), 0.5 * run(plain), atol=1e-3)


def test_router_bias_picks_experts_but_does_not_weight_them():
    c = MoEConfig(
        8,
        4,
        num_experts=4,
        top_k=2,
        num_shared_experts=1,
        n_group=1,
        topk_group=1,
        renormalize=True,
        routed_scaling_factor=2.5,
    )
    router = Router(c)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.0]))
    x = torch.randn(3, 8)
    ids, weights = router(x)
    assert sorted(ids[0].tolist()) == [2, 3]  # the bias decides the choice ...
    scores = (x @ router.weight.T).sigmoid()[:, 2:]
    assert torch.allclose(weights.sort(-1).values, (scores / scores.sum(-1, keepdim=True) * 2.5).sort(-1).values)


@pytest.fixture(scope="module")
def k3_runner(kimi_k3_dir) -> ModelRunner:
    config = EngineConfig.of(
        dtype="float32", device="cpu", block_size=4, num_kv_blocks=32, num_state_slots=1, kv_cache_prefault=False
    )
    return ModelRunner(config, kimi_k3_dir)


def _switch_off(runner: ModelRunner, switch: str) -> list[tuple[object, str, object]]:
    """Turn one K3 switch off in place; returns what to restore."""
    model = runner.model.model
    if switch == "attn_res_block_size":
        return [(model, "block_size", model.block_size)]
    if switch == "mla_use_output_gate":
        return [(layer.self_attn, "g_proj", layer.self_attn.g_proj) for layer in model.layers if not layer.is_kda]
    return [
        (layer.self_attn, "gate_lower_bound", layer.self_attn.gate_lower_bound)
        for layer in model.layers
        if layer.is_kda
    ]


@pytest.mark.parametrize("switch", ["attn_res_block_size", "mla_use_output_gate", "gate_lower_bound"])
def test_each_k3_switch_changes_the_output(k3_runner, switch):
    ids = list(range(40, 80))
    cuts = [30, 31, 40]
    on = chunked_logits(k3_runner, ids, cuts)
    restore = _switch_off(k3_runner, switch)
    try:
        for obj, attr, _ in restore:
            setattr(obj, attr, None)
        off = chunked_logits(k3_runner, ids, cuts)
    finally:
        for obj, attr, value in restore:
            setattr(obj, attr, value)
    assert (on - off).abs().max().item() > 1e-2
    assert torch.equal(chunked_logits(k3_runner, ids, cuts), on)
