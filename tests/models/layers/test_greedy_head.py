"""The greedy head (greedy_head.c's linear_argmax and linear_argmax_f32): each row's argmax of the float32 logits, from
integer bounds and the few logits they leave, must be the token the full head and its argmax give: the first
largest, ties included. In bf16 it runs where the CPU has AVX512-VNNI and the head sums on the AVX512-BF16 path;
in float32 where it has AVX2 with FMA and F16C. Each test runs for both dtypes where the CPU has them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridserve.engine.llm import LLM
from hybridserve.models.layers.linear import NativeLinear, pack_linears
from hybridserve.models.layers.native import LinearKernels, load_linear_kernels
from hybridserve.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture(scope="module")
def kernels(dtype: torch.dtype) -> LinearKernels:
    kernels = load_linear_kernels()
    if not kernels.can_argmax(torch.zeros(16, 64, dtype=dtype)):
        pytest.skip(
            f"the {dtype} greedy head needs AVX512-VNNI with AVX512-BF16 and a head not on AMX's tiles (bf16), or "
            "AVX2 with FMA and F16C (float32)"
        )
    return kernels


def _weight(n: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, 1, generator=g) * 2 + 0.05  # rows of different sizes: a scale per row matters
    return (torch.randn(n, k, generator=g) * scales).to(dtype)


def _full(kernels: LinearKernels, x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    return kernels.linear(x, panels, w.shape[0], None, True)[:, :n].argmax(-1)


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 576, 4099), (2, 130, 1000), (13, 577, 1000), (64, 64, 49), (70, 7, 33), (3, 576, 16), (25, 130, 2048)],
)
def test_the_argmax_is_the_full_heads(kernels: LinearKernels, dtype: torch.dtype, m: int, k: int, n: int) -> None:
    w = _weight(n, k, seed=m * 1000 + k, dtype=dtype)
    panels, (q, meta) = kernels.pack(w), kernels.pack_argmax(w)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    tokens = kernels.argmax(x, w, q, meta, n)
    assert (tokens >= 0).all(), "random logits are spread enough for the bounds to decide every row"
    assert tokens.tolist() == _full(kernels, x, w, panels, n).tolist()


def test_ties_go_to_the_first_column_and_near_ties_to_the_larger(kernels: LinearKernels, dtype: torch.dtype) -> None:
    k, n = 576, 3000
    w = _weight(n, k, seed=7, dtype=dtype)
    x = w[100:101].clone()  # its own row scores highest
    w[2500] = w[100]  # an exact tie, later: still 100
    w[40] = w[100]  # an exact tie, earlier: 40
    nudged = w[100].clone()
    nudged[:1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32).add_(1)  # one step further from 0
    w[1700] = nudged  # x[0] times it a step larger: a larger logit, unless the sum's rounding takes the step
    panels, (q, meta) = kernels.pack(w), kernels.pack_argmax(w)
    full = _full(kernels, x, w, panels, n)
    assert kernels.argmax(x, w, q, meta, n).tolist() == full.tolist()
    assert full.item() in (40, 1700)


def test_a_row_it_cannot_bound_is_left_undecided_and_the_head_computes_it(
    kernels: LinearKernels, dtype: torch.dtype
) -> None:
    k, n = 64, 40000
    w = _weight(n, k, seed=3, dtype=dtype)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[1] = 0  # every logit 0, every column a candidate: more than the lists hold (4096 a thread)
    x[3, 7] = float("nan")
    x[4] = 1e-30  # tiny logits: the bounds shrink with them
    head = NativeLinear(nn.Linear(k, n, bias=False).to(dtype), kernels, float_out=True, argmax=True)
    with torch.no_grad():
        head.panels, head.argmax_tables = kernels.pack(w), (w, *kernels.pack_argmax(w))
    tokens = kernels.argmax(x, *head.argmax_tables, n)
    assert tokens[1] == -1 and tokens[3] == -1
    assert head.argmax(x, n).tolist() == head(x).argmax(-1).tolist()


def test_only_the_first_n_columns_count(kernels: LinearKernels, dtype: torch.dtype) -> None:
    """A head padded past the vocabulary: the padding's columns are never picked, even when they score higher."""
    k, n = 96, 700
    w = _weight(n, k, seed=11, dtype=dtype)
    x = w[650:651].clone()
    panels, (q, meta) = kernels.pack(w), kernels.pack_argmax(w)
    assert kernels.argmax(x, w, q, meta, n).item() == 650
    assert kernels.argmax(x, w, q, meta, 600).tolist() == _full(kernels, x, w, panels, 600).tolist()


def test_bad_inputs_name_what_is_wrong(kernels: LinearKernels, dtype: torch.dtype) -> None:
    w = _weight(40, 32, seed=1, dtype=dtype)
    q, meta = kernels.pack_argmax(w)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="of the weight's dtype"):
        kernels.argmax(torch.zeros(2, 32, dtype=other), w, q, meta, 40)
    with pytest.raises(ValueError, match="n 0"):
        kernels.argmax(torch.zeros(2, 32, dtype=dtype), w, q, meta, 0)
    w[3, 4] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        kernels.pack_argmax(w)


def test_only_a_head_without_bias_keeps_the_int8_copy(kernels: LinearKernels, dtype: torch.dtype) -> None:
    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(64, 64).to(dtype), nn.Linear(64, 50, bias=False).to(dtype)
    pack_linears(model, kernels)
    assert model.lm_head.argmax_tables is not None and model.proj.argmax_tables is None
    biased = NativeLinear(nn.Linear(64, 50).to(dtype), kernels, float_out=True, argmax=True)
    assert biased.argmax_tables is None and biased.argmax(torch.zeros(1, 64, dtype=dtype), 50) is None


def test_greedy_generation_is_token_for_token_the_full_heads(
    kernels: LinearKernels, dtype: torch.dtype, smollm2_dir
) -> None:
    """The default model: a batch of greedy requests gives the same tokens with the greedy head as with the full
    head and the sampler's argmax; a request that wants logprobs takes the full head alongside."""
    llm = LLM(
        str(smollm2_dir),
        dtype=str(dtype).removeprefix("torch."),
        device="cpu",
        enable_prefix_caching=False,
        kv_cache_prefault=False,
    )
    head = llm.core.runner.model.lm_head
    assert isinstance(head, NativeLinear) and head.argmax_tables is not None
    prompts = [f"Write a short poem about {t}." for t in ("the sea", "a clock", "winter", "a fox", "rain", "bread")]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    fast = [o.outputs[0].token_ids for o in llm.generate(ids, greedy)]
    logprobs = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    with_logprobs = [o.outputs[0].token_ids for o in llm.generate(ids[:2], logprobs)]
    tables, head.argmax_tables = head.argmax_tables, None
    try:
        full = [o.outputs[0].token_ids for o in llm.generate(ids, greedy)]
    finally:
        head.argmax_tables = tables
    assert fast == full
    assert with_logprobs == full[:2]


@pytest.mark.parametrize("threads", [1, 3, 7])
def test_any_team_of_threads_gives_the_same_tokens(kernels: LinearKernels, dtype: torch.dtype, threads: int) -> None:
    """The bound pass's panels go as the matmuls' pairs do (a thread's own share, then what the others left):
    with one thread or more threads than cores, every row's token is the full head's."""
    m, k, n = 25, 130, 2048
    w = _weight(n, k, seed=5, dtype=dtype)
    panels, (q, meta) = kernels.pack(w), kernels.pack_argmax(w)
    gen = torch.Generator().manual_seed(6)
    xs = [(torch.randn(m, k, generator=gen) * 3).to(dtype) for _ in range(2)]
    want = [_full(kernels, x, w, panels, n).tolist() for x in xs]
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(10):
            for x, tokens in zip(xs, want, strict=True):
                assert kernels.argmax(x, w, q, meta, n).tolist() == tokens
    finally:
        torch.set_num_threads(default)
