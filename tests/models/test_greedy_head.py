"""The greedy head (linear.c's linear_argmax): each row's argmax of the float32 logits, from int8 bounds and the
few logits they leave, must be the token the full head and its argmax give: the first largest, ties included.
It runs where the CPU has AVX512-VNNI and the head sums on the AVX512-BF16 path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridserve.engine.llm import LLM
from hybridserve.models.layers.linear import NativeLinear, pack_linears
from hybridserve.models.layers.native import LinearKernels, load_linear_kernels
from hybridserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def kernels() -> LinearKernels:
    kernels = load_linear_kernels()
    if not kernels.can_argmax(torch.zeros(16, 64, dtype=torch.bfloat16)):
        pytest.skip("the greedy head needs AVX512-VNNI with AVX512-BF16, and a head not on AMX's tiles")
    return kernels


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, 1, generator=g) * 2 + 0.05  # rows of different sizes: a scale per row matters
    return (torch.randn(n, k, generator=g) * scales).to(torch.bfloat16)


def _full(kernels: LinearKernels, x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    return kernels.linear(x, panels, w.shape[0], None, True)[:, :n].argmax(-1)


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 576, 4099), (13, 577, 1000), (64, 64, 49), (70, 7, 33), (3, 576, 16), (25, 130, 2048)],
)
def test_the_argmax_is_the_full_heads(kernels: LinearKernels, m: int, k: int, n: int) -> None:
    w = _weight(n, k, seed=m * 1000 + k)
    panels, (q, meta) = kernels.pack(w), kernels.pack_argmax(w)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(n)) * 3).to(torch.bfloat16)
    tokens = kernels.argmax(x, w, q, meta, n)
    assert (tokens >= 0).all(), "random logits are spread enough for the bounds to decide every row"
    assert tokens.tolist() == _full(kernels, x, w, panels, n).tolist()


def test_ties_go_to_the_first_column_and_near_ties_to_the_larger(kernels: LinearKernels) -> None:
    k, n = 576, 3000
    w = _weight(n, k, seed=7)
    x = w[100:101].clone()  # its own row scores highest
    w[2500] = w[100]  # an exact tie, later: still 100
    w[40] = w[100]  # an exact tie, earlier: 40
    nudged = w[100].clone()
    nudged[0] = torch.nextafter(nudged[0].float(), torch.tensor(torch.inf)).to(torch.bfloat16)
    w[1700] = nudged  # one bf16 step larger in one element: a different logit, if x[0] > 0
    panels, (q, meta) = kernels.pack(w), kernels.pack_argmax(w)
    full = _full(kernels, x, w, panels, n)
    assert kernels.argmax(x, w, q, meta, n).tolist() == full.tolist()
    assert full.item() in (40, 1700)


def test_a_row_it_cannot_bound_is_left_undecided_and_the_head_computes_it(kernels: LinearKernels) -> None:
    k, n = 64, 40000
    w = _weight(n, k, seed=3)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x[1] = 0  # every logit 0, every column a candidate: more than the lists hold (4096 a thread)
    x[3, 7] = float("nan")
    x[4] = 1e-30  # tiny logits: the bounds shrink with them
    head = NativeLinear(nn.Linear(k, n, bias=False), kernels, float_out=True, argmax=True)
    with torch.no_grad():
        head.panels, head.argmax_tables = kernels.pack(w), (w, *kernels.pack_argmax(w))
    tokens = kernels.argmax(x, *head.argmax_tables, n)
    assert tokens[1] == -1 and tokens[3] == -1
    assert head.argmax(x, n).tolist() == head(x).argmax(-1).tolist()


def test_only_the_first_n_columns_count(kernels: LinearKernels) -> None:
    """A head padded past the vocabulary: the padding's columns are never picked, even when they score higher."""
    k, n = 96, 700
    w = _weight(n, k, seed=11)
    x = w[650:651].clone()
    panels, (q, meta) = kernels.pack(w), kernels.pack_argmax(w)
    assert kernels.argmax(x, w, q, meta, n).item() == 650
    assert kernels.argmax(x, w, q, meta, 600).tolist() == _full(kernels, x, w, panels, 600).tolist()


def test_bad_inputs_name_what_is_wrong(kernels: LinearKernels) -> None:
    w = _weight(40, 32, seed=1)
    q, meta = kernels.pack_argmax(w)
    with pytest.raises(ValueError, match="bf16 rows"):
        kernels.argmax(torch.zeros(2, 32), w, q, meta, 40)
    with pytest.raises(ValueError, match="n 0"):
        kernels.argmax(torch.zeros(2, 32, dtype=torch.bfloat16), w, q, meta, 0)
    w[3, 4] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        kernels.pack_argmax(w)


def test_only_a_bf16_head_without_bias_keeps_the_int8_copy(kernels: LinearKernels) -> None:
    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(64, 64).to(torch.bfloat16), nn.Linear(64, 50, bias=False).to(torch.bfloat16)
    pack_linears(model, kernels)
    assert model.lm_head.argmax_tables is not None and model.proj.argmax_tables is None
    float_head = NativeLinear(nn.Linear(64, 50, bias=False), kernels, float_out=True, argmax=True)
    assert float_head.argmax_tables is None and float_head.argmax(torch.zeros(1, 64), 50) is None


def test_greedy_generation_is_token_for_token_the_full_heads(kernels: LinearKernels, smollm2_dir) -> None:
    """The default model in bf16: a batch of greedy requests gives the same tokens with the greedy head as with
    the full head and the sampler's argmax; a request that wants logprobs takes the full head alongside."""
    llm = LLM(str(smollm2_dir), dtype="bfloat16", device="cpu", enable_prefix_caching=False)
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
