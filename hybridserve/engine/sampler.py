"""Batched sampling for one engine step: logprobs, logit processing, greedy argmax and seeded random draws.

Order, as vLLM does it: logprobs from the raw logits; then logit_bias, min_tokens, repetition penalty,
frequency/presence penalties; the grammar mask of constrained rows (forbidden tokens to -inf); greedy rows
take the argmax; random rows apply temperature, top-k, top-p and min-p and draw by the exponential race
(argmax of probs / Exp(1) noise). A seeded row draws its noise from its own generator, so its tokens
depend only on its seed and its logits, never on the rest of the batch. Logprobs stay those of the raw
model distribution for constrained rows too, so a listed alternative may be a token the grammar forbade.

Speculative decoding (`Sampler.verify`) samples every position of a request's last known token and its draft
tokens as plain decoding would, and keeps each draft while it equals the token sampled at its position. For a
random row the exponential race accepts draft t with probability p(t) and, where it rejects t, yields a token
drawn from p with t's mass removed, renormalised: exactly rejection sampling of a point-mass draft, so outputs
keep their distribution; and a seeded request draws one noise row per token it keeps, so its tokens are those
it samples without drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from hybridserve.engine.protocol import TokenLogprobs
from hybridserve.engine.structured_output import TokenMask
from hybridserve.models.layers.native import FusedOps
from hybridserve.sampling_params import SamplingParams

_NUCLEUS_CANDIDATES = 1024


@dataclass(eq=False)
class SamplingState:
    """Per-request sampler state, created once when a request is first scheduled, reused every step."""

    params: SamplingParams
    prompt_token_ids: list[int]  # never changes for the life of the state
    output_token_ids: list[int]  # the runner appends each sampled token to this list (shared object)
    blocked_until_min_tokens: list[int]  # masked to -inf while len(output) < min_tokens
    generator: torch.Generator | None  # from params.seed, on the logits device; None if no seed

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_ids: list[int],
        device: torch.device,
    ) -> SamplingState:
        stops = params.stop_token_ids if params.ignore_eos else (*eos_token_ids, *params.stop_token_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(params, prompt_token_ids, output_token_ids, list(dict.fromkeys(stops)), generator)

    def skip_draws(self, num_tokens: int, vocab_size: int) -> None:
        """Advance a seeded generator past `num_tokens` tokens sampled elsewhere (a prefill worker sampled the
        first one), so the tokens sampled here are the ones one engine would have drawn."""
        if self.generator is None or self.params.greedy:
            return
        noise = torch.empty(vocab_size, dtype=torch.float32, device=self.generator.device)
        for _ in range(num_tokens):
            noise.uniform_(generator=self.generator)

    def rewind(self, generator_state: torch.Tensor, num_tokens: int, vocab_size: int) -> None:
        """Set the generator back to `generator_state`, then past the draws of `num_tokens` tokens."""
        if self.generator is None:
            raise RuntimeError("an unseeded request has no generator to rewind")
        self.generator.set_state(generator_state)
        self.skip_draws(num_tokens, vocab_size)

    @cached_property
    def prompt_ids(self) -> torch.Tensor:
        """The prompt as a CPU int64 tensor, built once (repetition penalty reads it every step)."""
        return torch.tensor(self.prompt_token_ids, dtype=torch.long)

    @property
    def needs_processing(self) -> bool:
        p = self.params
        return bool(
            p.logit_bias
            or len(self.output_token_ids) < p.min_tokens
            or p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0
        )


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None  # None unless params.logprobs is not None
    prompt_logprobs: list[TokenLogprobs] | None = None  # with a request's first token, if it asked for them
    # Speculative decoding: the draft tokens accepted before token_id, in order, each with its logprobs;
    # token_id is the token sampled where the first draft was rejected, or after the last one.
    accepted: tuple[SampleResult, ...] = ()


class Sampler:
    def __init__(self, vocab_size: int, native: FusedOps | None = None) -> None:
        """native: the fused CPU ops, whose argmax takes the logits it can (PyTorch's argmax the others)."""
        self.vocab_size = vocab_size
        self.native = native

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first largest entry, as torch.argmax(dim=-1)."""
        if self.native is not None and self.native.can_argmax(logits):
            return self.native.argmax(logits)
        return logits.argmax(dim=-1)

    @staticmethod
    def plain_greedy(states: Sequence[SamplingState]) -> bool:
        """Whether every row's token is its logits' argmax and nothing else is wanted of them (no logprobs,
        penalties, biases or bans): then the argmax alone may come from elsewhere (a model's greedy_tokens)."""
        return all(s.params.greedy and s.params.logprobs is None and not s.needs_processing for s in states)

    def __call__(
        self, logits: torch.Tensor, states: Sequence[SamplingState], mask: TokenMask | None = None
    ) -> list[SampleResult]:
        """logits: [B, V] (any float dtype, any device) for the B requests in `states`, same order; `mask`
        limits the constrained rows to their grammar's allowed tokens.

        Columns past vocab_size (a padded LM head) are ignored.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states) or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be [{len(states)}, >= {self.vocab_size}] for {len(states)} requests, "
                f"got {list(logits.shape)}"
            )
        logits = logits[:, : self.vocab_size]
        if mask is None and self.plain_greedy(states):
            return [SampleResult(t, None) for t in self.argmax(logits).tolist()]

        x = logits.to(torch.float32, copy=True)
        want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        want_idx = torch.tensor(want, dtype=torch.long, device=x.device)
        raw_logprobs = torch.log_softmax(x[want_idx], dim=-1)
        apply_penalties(x, states)
        if mask is not None:
            mask.apply(x)
        tokens = _pick_tokens(x, states, self.argmax)
        by_row: dict[int, TokenLogprobs] = {}
        if want:
            ks = [states[i].params.logprobs or 0 for i in want]
            by_row = dict(zip(want, token_logprobs(raw_logprobs, tokens[want_idx], ks), strict=True))
        return [SampleResult(t, by_row.get(i)) for i, t in enumerate(tokens.tolist())]

    def verify(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        drafts: Sequence[list[int]],
        mask: TokenMask | None = None,
    ) -> list[SampleResult]:
        """Speculative decoding. logits: per request (in `states` order) a row for its last known token and one
        per token of its draft (`drafts`, aligned with `states`; empty for a request without one). Each row is
        sampled with the drafts before it taken as output (penalties, min_tokens see them); a request's result
        carries the drafts accepted and the token sampled after them. `mask` (one row per request) may
        constrain only requests without a draft: a grammar would have to advance over the draft."""
        rows: list[SamplingState] = []
        firsts: list[int] = []
        for state, draft in zip(states, drafts, strict=True):
            firsts.append(len(rows))
            rows.append(state)
            rows.extend(
                dataclasses.replace(state, output_token_ids=state.output_token_ids + draft[:j])
                for j in range(1, len(draft) + 1)
            )
        if mask is not None:
            if any(drafts[r] for r in mask.rows):
                raise ValueError("a grammar-constrained request cannot verify draft tokens")
            owner = torch.repeat_interleave(torch.arange(len(drafts)), torch.tensor([len(d) + 1 for d in drafts]))
            mask = TokenMask(
                mask.bitmask.index_select(0, owner.to(mask.bitmask.device)), [firsts[r] for r in mask.rows]
            )
        rewind = {
            i: s.generator.get_state()
            for i, (s, draft) in enumerate(zip(states, drafts, strict=True))
            if draft and s.generator is not None and not s.params.greedy
        }
        sampled = self(logits, rows, mask)
        results = []
        for i, (first, draft) in enumerate(zip(firsts, drafts, strict=True)):
            n = 0
            while n < len(draft) and sampled[first + n].token_id == draft[n]:
                n += 1
            results.append(dataclasses.replace(sampled[first + n], accepted=tuple(sampled[first : first + n])))
            if i in rewind and n < len(draft):  # the rows after the rejection drew noise no token keeps
                states[i].rewind(rewind[i], n + 1, self.vocab_size)
        return results


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """In place on float32 logits [B, V]: logit_bias, min_tokens, repetition, frequency/presence."""
    _add_logit_bias(logits, states)
    _block_until_min_tokens(logits, states)
    _repetition_penalty(logits, states)
    _frequency_presence_penalty(logits, states)


def _add_logit_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    rows, cols, biases = [], [], []
    for i, s in enumerate(states):
        for token_id, bias in s.params.logit_bias.items():
            rows.append(i)
            cols.append(token_id)
            biases.append(bias)
    if rows:
        index = _checked_index(rows, cols, logits, "logit_bias")
        values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, values, accumulate=True)


def _block_until_min_tokens(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    rows, cols = [], []
    for i, s in enumerate(states):
        if len(s.output_token_ids) < s.params.min_tokens:
            rows.extend([i] * len(s.blocked_until_min_tokens))
            cols.extend(s.blocked_until_min_tokens)
    if rows:
        logits[_checked_index(rows, cols, logits, "stop or EOS")] = float("-inf")


def _repetition_penalty(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Tokens in prompt or output: positive logits divided by the penalty, negative ones multiplied."""
    rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if not rows:
        return
    r, c = _pairs(rows, [torch.cat((states[i].prompt_ids, _ids(states[i].output_token_ids))) for i in rows], logits)
    penalty = _per_row([s.params.repetition_penalty for s in states], logits)[r]
    values = logits[r, c]
    # A repeated (row, id) pair writes the same value each time, so each token is penalised once.
    logits[r, c] = torch.where(values > 0, values / penalty, values * penalty)


def _frequency_presence_penalty(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Output tokens only: logit -= frequency * count + presence."""
    rows = [i for i, s in enumerate(states) if s.params.frequency_penalty or s.params.presence_penalty]
    if not rows:
        return
    r, c = _pairs(rows, [_ids(states[i].output_token_ids) for i in rows], logits)
    logits[r, c] = logits[r, c] - _per_row([s.params.presence_penalty for s in states], logits)[r]  # once
    frequency = _per_row([s.params.frequency_penalty for s in states], logits)[r]
    logits.index_put_((r, c), -frequency, accumulate=True)  # once per occurrence


def _pick_tokens(
    logits: torch.Tensor, states: Sequence[SamplingState], argmax: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if not rows:
        return argmax(logits)
    if len(rows) == len(states):
        return _sample(logits, states)
    tokens = argmax(logits)
    idx = torch.tensor(rows, device=logits.device)
    tokens[idx] = _sample(logits[idx], [states[i] for i in rows])
    return tokens


def _sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Random rows, in place: temperature, top-k, top-p, min-p, then the exponential race."""
    params = [s.params for s in states]
    logits.div_(_column([p.temperature for p in params], logits))
    _top_k(logits, [p.top_k for p in params])
    probs = logits.softmax(dim=-1)
    _top_p(probs, [p.top_p for p in params])
    _min_p(probs, [p.min_p for p in params])
    return probs.div_(_race_noise(probs, [s.generator for s in states])).argmax(dim=-1)


def _top_k(logits: torch.Tensor, top_ks: list[int]) -> None:
    """Keep the k largest logits per row (ties with the k-th are kept); 0, -1 or >= V: keep all."""
    ks = [k if 0 < k < logits.shape[1] else 0 for k in top_ks]
    if not any(ks):
        return
    k = torch.tensor(ks, device=logits.device).unsqueeze(1)
    kth = logits.topk(max(ks), dim=-1).values.gather(1, (k - 1).clamp_(min=0))
    threshold = torch.where(k > 0, kth, float("-inf"))
    logits.masked_fill_(logits < threshold, float("-inf"))


def _top_p(probs: torch.Tensor, top_ps: list[float]) -> None:
    """Zero every token outside the smallest best-first set whose mass reaches top_p (at least one kept).

    The nucleus is looked for among the top _NUCLEUS_CANDIDATES tokens first; only when it does not fit
    there for some row is the whole vocabulary sorted (a full sort of [128, 150k] costs seconds on CPU).
    """
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return
    idx = torch.tensor(rows, device=probs.device)
    sub, top_p = probs[idx], _column([top_ps[i] for i in rows], probs)
    ordered, order = sub.topk(min(_NUCLEUS_CANDIDATES, sub.shape[1]), dim=-1)
    mass = ordered.cumsum(dim=-1)
    if order.shape[1] < sub.shape[1] and not bool((mass[:, -1:] >= top_p).all()):
        ordered, order = sub.sort(dim=-1, descending=True)
        mass = ordered.cumsum(dim=-1)
    keep = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, order, mass.sub_(ordered) < top_p)
    probs[idx] = sub.masked_fill_(~keep, 0.0)


def _min_p(probs: torch.Tensor, min_ps: list[float]) -> None:
    """Zero tokens whose probability is below min_p times the row's largest."""
    if not any(min_ps):
        return
    threshold = probs.amax(dim=-1, keepdim=True) * _column(min_ps, probs)
    probs.masked_fill_(probs < threshold, 0.0)


def _race_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise as -log(U), U in [tiny, 1): finite and positive, so a zeroed token can never win.

    A seeded row takes exactly one V-sized draw from its own generator each step.
    """
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.uniform_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].uniform_(generator=generator)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_().neg_()


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Per row of log-probabilities `raw` [B, V]: the logprob and rank of `tokens`[row] and the top ks[row]."""
    chosen = raw.gather(1, tokens.unsqueeze(1))
    ranks = (raw >= chosen).sum(dim=-1)  # ties count against the sampled token, as vLLM ranks
    top_values, top_ids = raw.topk(max(ks), dim=-1)
    return [
        TokenLogprobs(token, logprob, rank, list(zip(ids[:k], values[:k], strict=True)))
        for token, logprob, rank, ids, values, k in zip(
            tokens.tolist(),
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
            ks,
            strict=True,
        )
    ]


def _checked_index(
    rows: list[int], cols: list[int], logits: torch.Tensor, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _ids(cols)
    _check_in_vocab(ids, logits.shape[1], what)
    return torch.tensor(rows, device=logits.device), ids.to(logits.device)


def _pairs(rows: list[int], ids_per_row: list[torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors on the logits device for each listed row's CPU token ids."""
    ids = torch.cat(ids_per_row)
    _check_in_vocab(ids, logits.shape[1], "prompt or output")
    row_of = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(t) for t in ids_per_row]))
    return row_of.to(logits.device), ids.to(logits.device)


def _check_in_vocab(ids: torch.Tensor, vocab: int, what: str) -> None:
    if ids.numel() == 0:
        return
    low, high = torch.aminmax(ids)
    if low < 0 or high >= vocab:
        bad = ids[(ids < 0) | (ids >= vocab)]
        raise ValueError(f"{what} token id {bad[0].item()} is outside the vocabulary (size {vocab})")


def _per_row(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return _per_row(values, like).unsqueeze(1)


def _ids(token_ids: list[int]) -> torch.Tensor:
    return torch.tensor(token_ids, dtype=torch.long)
