"""Kimi Linear logits parity with transformers' kimi_linear (fp32), through prefill, chunked prefill on
context and decode; the K3 checkpoint's prefill and decode paths agree with each other."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hybridserve.config import EngineConfig
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.parity import chunked_logits

LENGTHS = [1, 7, 16, 33, 70]  # mixed: shorter and longer than KDA's chunk and MLA's blocks
DECODE_STEPS = 32
TOLERANCE = 2e-4


def _runner(hf_dir, native_kernels: bool = True) -> ModelRunner:
    config = EngineConfig.of(
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=64,
        num_state_slots=2,
        native_kernels=native_kernels,
        kv_cache_prefault=False,
    )
    return ModelRunner(config, hf_dir)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_kimi(kimi_linear_dir):
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM.from_pretrained(kimi_linear_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[True, False], ids=["native-kernels", "pytorch-ops"])
def runner(kimi_linear_dir, request) -> ModelRunner:
    """Both ways the engine computes a layer on CPU; the PyTorch-ops one is also what CUDA runs."""
    runner = _runner(kimi_linear_dir, request.param)
    assert (runner.backend.state_kernel is not None) == request.param
    assert (runner.model.model.norm.native is not None) == request.param
    return runner


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_then_32_decode_steps_match_transformers(runner, hf_kimi, n):
    ids = _ids(n + DECODE_STEPS, seed=n)
    ref = _reference(hf_kimi, ids)
    ours = chunked_logits(runner, ids, [n, *range(n + 1, n + DECODE_STEPS + 1)])
    assert (ours - ref).abs().max().item() < TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    runner.check_integrity()


def test_chunked_prefill_on_context_matches_transformers(runner, hf_kimi):
    ids = _ids(90, seed=1)
    ref = _reference(hf_kimi, ids)
    ours = chunked_logits(runner, ids, [5, 6, 23, 24, 61, 89, 90])  # prefill, decode, prefill on context, ...
    assert (ours - ref).abs().max().item() < TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_transformers_in_memory_names_load_the_same_model(runner, hf_kimi, tmp_path, kimi_linear_dir):
    """transformers' module names (forget_gate.*, one conv1d, stacked experts) map to the same model."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((kimi_linear_dir / name).read_bytes())
    state = {k: v.contiguous() for k, v in hf_kimi.state_dict().items()}
    assert any(".forget_gate." in k for k in state) and any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, tmp_path / "model.safetensors")
    ids = _ids(40, seed=2)
    cuts = [30, 31, 40]
    diff = chunked_logits(_runner(tmp_path), ids, cuts) - chunked_logits(runner, ids, cuts)
    assert diff.abs().max().item() < 1e-5


@pytest.mark.parametrize("native_kernels", [True, False], ids=["native-kernels", "pytorch-ops"])
def test_k3_prefill_equals_token_by_token_decode(kimi_k3_dir, native_kernels):
    """The chunked (prefill) and recurrent (decode) KDA forms, the MLA prefill and absorbed-decode paths and
    the depth mix agree on the K3 checkpoint, which has no reference implementation."""
    runner = _runner(kimi_k3_dir, native_kernels)
    ids = _ids(50, seed=3)
    whole = chunked_logits(runner, ids, [len(ids)])
    stepwise = chunked_logits(runner, ids, list(range(1, len(ids) + 1)))
    mixed = chunked_logits(runner, ids, [17, 18, 19, 40, 50])
    assert (whole - stepwise).abs().max().item() < TOLERANCE
    assert (whole - mixed).abs().max().item() < TOLERANCE
    assert torch.equal(whole.argmax(-1), stepwise.argmax(-1))
