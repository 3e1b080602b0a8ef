"""Loading one tensor- / expert-parallel rank's shard: the ranks' slices make up the whole load exactly, every
checkpoint tensor has a rule, an indivisible split is refused by name, and only slices are read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

from hybridserve.models import registry
from hybridserve.models.base import CausalLM
from hybridserve.models.kimi_linear import KimiLinearForCausalLM
from hybridserve.models.llama import LlamaForCausalLM
from hybridserve.models.loader import safetensors as loader
from hybridserve.models.loader.kimi_linear import canonical_state
from hybridserve.models.loader.safetensors import load_state_dict, pack
from hybridserve.models.loader.sharding import Shard, ShardPlan

CPU = torch.device("cpu")
TP2 = [Shard(tp_rank=r, tp_size=2) for r in range(2)]
EP2 = [Shard(ep_rank=r, ep_size=2) for r in range(2)]
TP2_EP2 = [Shard(tp_rank=r, tp_size=2, ep_rank=r, ep_size=2) for r in range(2)]
# vocab 251 is odd: rank 0 reads 126 rows, rank 1 the other 125.
LLAMA = dict(vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)  # fmt: skip


def save_random(config: PretrainedConfig, path: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random(LlamaConfig(**LLAMA), tmp_path_factory.mktemp("llama-tiny"))


def model_of(hf_dir: Path) -> tuple[type[CausalLM], ShardPlan]:
    config = registry.load_config(hf_dir)
    cls = registry.model_class(config)
    return cls, ShardPlan(cls.shard_plan, config)


def load(hf_dir: Path, shard: Shard | None = None) -> dict[str, torch.Tensor]:
    cls, plan = model_of(hf_dir)
    return load_state_dict(hf_dir, torch.float32, CPU, cls.fp32_parameters, shard, plan)


def assert_partition(full: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]], shards: list[Shard], plan):
    """Split tensors concatenate back to the whole along their plan's dimension, replicated ones are equal on
    every rank, and each routed expert is on exactly the rank whose range holds it."""
    for name, whole in full.items():
        style = plan.rule(name).style
        tp = shards[0].tp_size
        if style == "expert":
            holders = [i for i, state in enumerate(ranks) if name in state]
            index = int(name.split(".experts.")[1].split(".")[0])
            per = 8 // shards[0].ep_size  # the tiny Kimi checkpoints have 8 experts
            assert holders == [i for i, s in enumerate(shards) if s.ep_rank == index // per], name
            assert all(torch.equal(ranks[i][name], whole) for i in holders), name
        elif style == "replicate" or tp == 1 or (style == "rowwise" and whole.dim() == 1):
            assert all(torch.equal(state[name], whole) for state in ranks), name
        else:
            parts = [state[name] for state in ranks]
            assert torch.equal(torch.cat(parts, dim=1 if style == "rowwise" else 0), whole), name
            assert all(p.is_contiguous() for p in parts), name
    for state in ranks:
        assert set(state) <= set(full)


def test_llama_tp_ranks_make_up_the_whole_load(llama_dir: Path) -> None:
    cls, plan = model_of(llama_dir)
    full = load(llama_dir)
    ranks = [load(llama_dir, s) for s in TP2]
    assert_partition(full, ranks, TP2, plan)
    assert [r["model.embed_tokens.weight"].shape[0] for r in ranks] == [126, 125]
    # q, k and v split by heads, then packed per rank: rank r's qkv rows are its q heads, then k's, then v's.
    q, kv = 4 * 16, 2 * 16
    whole = pack(full, cls.packed_modules)["model.layers.1.self_attn.qkv_proj.bias"]
    for r, state in enumerate(ranks):
        qkv = pack(state, cls.packed_modules)["model.layers.1.self_attn.qkv_proj.bias"]
        mine = [whole[start + r * n // 2 : start + (r + 1) * n // 2] for start, n in ((0, q), (q, kv), (q + kv, kv))]
        assert torch.equal(qkv, torch.cat(mine))


@pytest.mark.parametrize("shards", [TP2, EP2, TP2_EP2], ids=["tp2", "ep2", "tp2-ep2"])
@pytest.mark.parametrize("checkpoint", ["kimi_linear_dir", "kimi_k3_dir"])
def test_kimi_ranks_make_up_the_whole_load(checkpoint: str, shards: list[Shard], request) -> None:
    hf_dir = request.getfixturevalue(checkpoint)
    cls, plan = model_of(hf_dir)
    full = load(hf_dir)
    ranks = [load(hf_dir, s) for s in shards]
    assert_partition(full, ranks, shards, plan)
    # Each rank's names adapt and pack as a whole load's do: its experts a contiguous range, stacked in order.
    whole = pack(canonical_state(full), cls.packed_modules)
    for shard, state in zip(shards, ranks, strict=True):
        packed = pack(canonical_state(state), cls.packed_modules)
        per = 8 // shard.ep_size
        experts = slice(shard.ep_rank * per, (shard.ep_rank + 1) * per)
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            key = f"model.layers.1.mlp.{name}"
            assert torch.equal(packed[key], whole[key][experts])
        kda = "model.layers.0.self_attn"
        assert packed[f"{kda}.in_proj.weight"].shape[0] == 2 * 16 + (4 + 3 * 64) // shard.tp_size
        assert packed[f"{kda}.conv1d.weight"].shape[0] == 3 * 64 // shard.tp_size


def checkpoint_names(hf_dir: Path) -> list[str]:
    with safe_open(hf_dir / "model.safetensors", framework="pt") as f:
        return list(f.keys())


def test_plan_has_exactly_one_rule_for_every_checkpoint_tensor(llama_dir, kimi_linear_dir, kimi_k3_dir) -> None:
    """Policy: every tensor matches exactly one rule, replicate included; none is replicated by default."""
    for hf_dir in (llama_dir, kimi_linear_dir, kimi_k3_dir):
        _, plan = model_of(hf_dir)
        for name in checkpoint_names(hf_dir):
            plan.rule(name)
    qwen3 = Qwen3Config(**{**LLAMA, "attention_bias": False}, head_dim=16)
    with torch.device("meta"):
        names = AutoModelForCausalLM.from_config(qwen3).state_dict()
    plan = ShardPlan(LlamaForCausalLM.shard_plan, qwen3)
    assert any(".q_norm." in n for n in names)
    for name in names:
        plan.rule(name)
    assert plan.rule("model.layers.0.self_attn.o_proj.bias").style == "rowwise"


def test_a_tensor_without_a_rule_or_with_two_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((llama_dir / "config.json").read_bytes())
    state = load_file(llama_dir / "model.safetensors")
    state["model.layers.0.mlp.extra_scale"] = torch.ones(3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as no_rule:
        load(tmp_path, TP2[0])
    assert str(no_rule.value) == (
        "checkpoint tensor model.layers.0.mlp.extra_scale matches no rule of the shard plan (replicate included)"
    )
    plan = ShardPlan({"model.layers.*.mlp.*": "replicate", "model.*.0.mlp.extra_scale": "colwise"}, LlamaConfig())
    with pytest.raises(ValueError) as two:
        plan.rule("model.layers.0.mlp.extra_scale")
    assert str(two.value) == (
        "checkpoint tensor model.layers.0.mlp.extra_scale matches several rules of the shard plan: "
        "['model.layers.*.mlp.*', 'model.*.0.mlp.extra_scale']"
    )


def test_heads_that_do_not_divide_are_refused_by_name(tmp_path: Path) -> None:
    """3 KV heads of 8 rows: 24 rows would split over 2 ranks, the heads would not."""
    heads = dict(num_hidden_layers=1, hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    config = LlamaConfig(**{**LLAMA, **heads})
    hf_dir = save_random(config, tmp_path)
    with pytest.raises(ValueError) as error:
        load(hf_dir, TP2[1])
    assert str(error.value) == (
        "cannot split model.layers.0.self_attn.k_proj.bias of shape [24] colwise over tensor-parallel size 2: "
        "3 heads (num_key_value_heads) do not divide among 2 ranks"
    )


def test_dimensions_and_experts_that_do_not_divide_are_refused_by_name(kimi_linear_dir: Path) -> None:
    plan = ShardPlan(LlamaForCausalLM.shard_plan, LlamaConfig(**LLAMA, head_dim=16))
    with pytest.raises(ValueError) as dim:
        plan.indices({"model.layers.0.mlp.down_proj.weight": [64, 97]}, TP2[0])
    assert str(dim.value) == (
        "cannot split model.layers.0.mlp.down_proj.weight of shape [64, 97] rowwise over tensor-parallel size 2: "
        "97 columns (dim 1) do not divide among 2 ranks"
    )
    with pytest.raises(ValueError) as experts:
        load(kimi_linear_dir, Shard(ep_rank=0, ep_size=3))
    assert str(experts.value) == (
        "cannot split model.layers.1.block_sparse_moe.experts.0.w1.weight of shape [32, 64] expert over "
        "expert-parallel size 3: 8 experts do not divide among 3 ranks"
    )


class ReadSpy:
    """Stands for safetensors.safe_open in the loader and counts what each tensor read returns."""

    def __init__(self) -> None:
        self.whole: list[str] = []
        self.sliced: dict[str, int] = {}  # name -> elements read

    def __call__(self, *args, **kwargs):
        return _SpyFile(self, safe_open(*args, **kwargs))


class _SpyFile:
    def __init__(self, spy: ReadSpy, f) -> None:
        self.spy, self.f = spy, f

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        self.spy.whole.append(name)
        return self.f.get_tensor(name)

    def get_slice(self, name: str):
        return _SpySlice(self.spy, name, self.f.get_slice(name))


class _SpySlice:
    def __init__(self, spy: ReadSpy, name: str, s) -> None:
        self.spy, self.name, self.s = spy, name, s

    def get_shape(self) -> list[int]:  # the header only
        return self.s.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self.s[index]
        self.spy.sliced[self.name] = self.spy.sliced.get(self.name, 0) + tensor.numel()
        return tensor


def test_a_rank_reads_only_its_slices(kimi_k3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, plan = model_of(kimi_k3_dir)
    full = load(kimi_k3_dir)
    spy = ReadSpy()
    monkeypatch.setattr(loader, "safe_open", spy)
    state = load(kimi_k3_dir, TP2_EP2[1])
    assert set(spy.whole).isdisjoint(spy.sliced) and len(spy.whole) == len(set(spy.whole))
    assert set(spy.whole) | set(spy.sliced) == set(state)  # nothing read and dropped: no other rank's expert
    for name in spy.whole:  # read whole: replicated, or one of this rank's experts
        rule = plan.rule(name)
        assert rule.style in ("replicate", "expert") or (rule.style == "rowwise" and full[name].dim() == 1), name
    for name, read in spy.sliced.items():  # read in part: what the rank keeps, half the tensor (vocab: a row more)
        assert read == state[name].numel(), name
        assert read <= (full[name].numel() + full[name].shape[-1]) // 2, name
    experts = [n for n in full if plan.rule(n).style == "expert"]
    assert 0 < len(set(experts) & set(state)) == len(experts) // 2


def test_size_one_loads_the_whole_checkpoint_as_before(llama_dir: Path) -> None:
    full = load_state_dict(llama_dir, torch.float32, CPU)
    whole = load_state_dict(llama_dir, torch.float32, CPU, (), Shard(), plan=None)  # the plan is not read
    assert full.keys() == whole.keys() and all(torch.equal(full[k], whole[k]) for k in full)
    with pytest.raises(ValueError, match="needs the model's shard plan"):
        load_state_dict(llama_dir, torch.float32, CPU, (), TP2[0])
    with pytest.raises(ValueError, match="tensor-parallel rank 2 is not a rank of a group of size 2"):
        Shard(tp_rank=2, tp_size=2)


def test_plans_name_known_styles_and_head_counts() -> None:
    ShardPlan(KimiLinearForCausalLM.shard_plan, AutoConfig.for_model("kimi_linear"))
    with pytest.raises(ValueError, match="unknown style 'columnwise'"):
        ShardPlan({"lm_head.weight": "columnwise"}, LlamaConfig())
    with pytest.raises(ValueError, match=r"the config has no head count \['num_heads'\]"):
        ShardPlan({"lm_head.weight": "colwise:num_heads"}, LlamaConfig())
