"""Kimi Delta Attention (KDA): linear attention with a per-channel decay and the delta rule.

Per token and head, with a [d_k, d_v] float32 state S:

    S = diag(exp(g)) S ;  S = S + beta * k (v - S^T k)^T ;  o = S^T q

Two forms of the same recurrence: `kda_recurrent` steps token by token (decode: one token per request,
batched over requests) and `kda_chunked` handles a chunk of C tokens at once (prefill). Within a chunk, with
G the cumulative log decay and S0 the state entering it, the delta-rule updates u_t = beta_t (v_t - S_t^T k_t)
solve one unit lower-triangular system:

    (I + A) U = beta (V - (exp(G) * K) S0),   A[t, s] = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])  (s < t)

after which the outputs and the final state are matmuls. exp(G_t - G_s) is formed pairwise (never as a
product of exp(G_t) and exp(-G_s), which overflows under strong decay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.layers.attention import AttentionMetadata

CHUNK = 16  # pairwise decays cost C*C*d per head and chunk: small chunks keep that in cache


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps): eps inside the root, as the reference kernels do."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token per row. q, k, g: [B, H, dk]; v: [B, H, dv]; beta: [B, H]; state: [B, H, dk, dv] float32,
    updated in place. q is already scaled. Returns o: [B, H, dv]."""
    state.mul_(g.exp().unsqueeze(-1))
    u = (v - torch.einsum("bhk,bhkv->bhv", k, state)) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * u.unsqueeze(-2))
    return torch.einsum("bhk,bhkv->bhv", q, state)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """One request's T tokens. q, k, g: [H, T, dk]; v: [H, T, dv]; beta: [H, T]; state: [H, dk, dv] float32,
    updated in place. q is already scaled. Returns o: [H, T, dv]."""
    h, t, dk = k.shape
    out = v.new_empty(h, t, v.shape[-1])
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        n = end - start
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end, None]
        cum = g[:, start:end].cumsum(1)  # [H, n, dk]
        future = torch.ones(n, n, dtype=torch.bool, device=k.device).triu_(1)
        # exp(G_t - G_s) for s <= t, zero for s > t: [H, n(t), n(s), dk]
        decay = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill_(future.unsqueeze(-1), float("-inf")).exp_()
        a = torch.einsum("htc,hsc,htsc->hts", kc, kc, decay).mul_(bc).tril_(-1)
        rhs = bc * (vc - (kc * cum.exp()) @ state)
        # unitriangular: the solver takes the diagonal as ones, so this solves (I + A) U = rhs
        u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # [H, n, dv]
        scores = torch.einsum("htc,hsc,htsc->hts", qc, kc, decay)
        out[:, start:end] = (qc * cum.exp()) @ state + scores @ u
        last = cum[:, -1:]  # [H, 1, dk]
        state.mul_(last.transpose(1, 2).exp()).add_((kc * (last - cum).exp()).transpose(1, 2) @ u)
    return out


@dataclass
class KDAConfig:
    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int
    rms_norm_eps: float
    gate_lower_bound: float | None  # K3: g = lower_bound * sigmoid(exp(A_log) * x) instead of the softplus form


class KimiDeltaAttention(nn.Module):
    """The KDA token mixer. `in_proj` computes the decay's and the output gate's low-rank inputs, beta's
    logits and q, k, v (before their short convolution) in one matmul, packed by the loader from the
    checkpoint's f_a/g_a/b/q/k/v projections; `conv1d` is the q, k and v convolutions stacked."""

    def __init__(self, c: KDAConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.dim = c.num_heads * c.head_dim
        self.gate_lower_bound = c.gate_lower_bound
        self.in_proj = nn.Linear(c.hidden_size, 3 * self.dim + 2 * c.head_dim + c.num_heads, bias=False)
        self.conv1d = nn.Conv1d(3 * self.dim, 3 * self.dim, c.conv_kernel, groups=3 * self.dim, bias=False)
        self.f_b_proj = nn.Linear(c.head_dim, self.dim, bias=False)
        self.g_b_proj = nn.Linear(c.head_dim, self.dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(c.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.dim, dtype=torch.float32))
        self.o_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.o_proj = nn.Linear(self.dim, c.hidden_size, bias=False)

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay g <= 0 from f_b(f_a(x)): [T, dim] -> [T, H, d] float32."""
        x = (f.float() + self.dt_bias.float()).view(f.shape[0], self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(self.num_heads, 1)
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(rate * x)
        return -rate * F.softplus(x)

    def forward(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: [T, hidden], the step's flat batch. cache: the state pool's tensors of this layer, conv tails
        [slots, 3*dim, kernel-1] (the convolution's last inputs) and states [slots, H, d, d] float32; both
        are read and updated at the step's requests' slots."""
        t = x.shape[0]
        d, h = self.head_dim, self.num_heads
        conv_state, state = cache
        f_a, g_a, b, qkv = self.in_proj(x).split([d, d, h, 3 * self.dim], dim=-1)
        qkv = qkv.contiguous()
        g = self.decay(self.f_b_proj(f_a))
        beta = torch.sigmoid(b.float())
        conv_w = self.conv1d.weight.squeeze(1)  # [3*dim, kernel]
        out = torch.empty(t, h, d, dtype=torch.float32, device=x.device)
        s = meta.states
        if s is None:
            raise ValueError("linear attention needs state slots in the step metadata")
        if meta.decode is not None:
            rows, slots = meta.decode.token_index, s.decode_slots
            window = torch.cat((conv_state.index_select(0, slots), qkv.index_select(0, rows).unsqueeze(-1)), dim=-1)
            conv_state.index_copy_(0, slots, window[..., 1:])
            mixed = F.silu((window * conv_w).sum(-1))  # [B, 3*dim]
            q, k, v = self._heads(mixed)
            g_rows, beta_rows = g.index_select(0, rows), beta.index_select(0, rows)
            if s.kernel is not None:
                o = s.kernel.decode(q, k, v, g_rows, beta_rows, state, slots)
            else:
                st = state.index_select(0, slots)
                o = kda_recurrent(q, k, v, g_rows, beta_rows, st)
                state.index_copy_(0, slots, st)
            out.index_copy_(0, rows, o)
        for p, slot in zip(meta.prefills, s.prefill_slots, strict=True):
            seq = torch.cat((conv_state[slot], qkv[p.start : p.end].T), dim=-1)  # [3*dim, kernel-1+n]
            conv_state[slot] = seq[:, seq.shape[1] - conv_state.shape[-1] :]
            mixed = F.silu(F.conv1d(seq.unsqueeze(0), self.conv1d.weight, groups=seq.shape[0])[0].T)  # [n, 3*dim]
            q, k, v = (z.transpose(0, 1) for z in self._heads(mixed))
            o = kda_chunked(q, k, v, g[p.start : p.end].transpose(0, 1), beta[p.start : p.end].T, state[slot])
            out[p.start : p.end] = o.transpose(0, 1)
        gate = self.g_b_proj(g_a).view(t, h, d)
        normed = F.rms_norm(out, (d,), self.o_norm.weight.float(), self.o_norm.eps) * torch.sigmoid(gate.float())
        return self.o_proj(normed.to(x.dtype).reshape(t, self.dim))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, 3*dim] after the convolution -> float32 q (normalised, scaled), k (normalised), v: [N, H, d]."""
        q, k, v = mixed.float().view(mixed.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return l2norm(q) * self.head_dim**-0.5, l2norm(k), v
