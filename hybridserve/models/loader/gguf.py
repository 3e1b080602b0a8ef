"""Convert a GGUF file into a cached Hugging Face-layout directory: config, float32 weights, tokenizer; and the
Q4_0, Q4_1 and Q8_0 blocks of its matmuls' weights (BLOCKS_DIR), from which CPU kernels sum those weights bitwise as
float32 from 19% or 28% of the memory."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from hybridserve.paths import cache_dir

logger = logging.getLogger("hybridserve.loader")

GGUF_MAGIC = b"GGUF"
FORMAT_VERSION = 5  # part of the cache key: bump when the converted layout changes
# Under the converted directory: <kind>.safetensors, a matmul weight's GGUF blocks of that kind, uint8 [rows,
# K / 32 * block bytes] under the weight's HF name (a tied head's under lm_head.weight: they are the head's blocks)
BLOCKS_DIR = "gguf_blocks"
BLOCK_KINDS = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    architecture: str
    permute_qk: bool  # llama.cpp interleaves Q/K rows for its rotary; HF uses rotate_half


ARCHS = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False),
}

TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# GGUF's keys for the sampling a model recommends → generation_config.json's names for them.
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
ATTENTION_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_PROJECTIONS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def default_cache_root() -> Path:
    return cache_dir("gguf")


def convert_gguf(path: Path, cache_root: Path | None = None) -> Path:
    """Return a cached HF directory holding `path` dequantized to float32; converts on first use."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    root = cache_root if cache_root is not None else default_cache_root()
    target = root / f"{path.stem}-{cache_key(path)}"
    if target.is_dir():
        logger.info("GGUF cache hit for %s: %s", path, target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        write_hf_dir(path, tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # a concurrent conversion finishing first is the only benign failure
            raise
        logger.info("GGUF %s was converted concurrently; using %s", path, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def cache_key(path: Path) -> str:
    stat = path.stat()
    ident = f"{FORMAT_VERSION}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


@contextmanager
def phase(name: str, path: Path) -> Iterator[None]:
    start = time.perf_counter()
    yield
    logger.info("GGUF %s: %s took %.2f s", path.name, name, time.perf_counter() - start)


def write_hf_dir(path: Path, out: Path) -> None:
    with phase("reading metadata", path):
        reader = gguf.GGUFReader(path)
        arch = str(field(reader, "general.architecture"))
        spec = ARCHS.get(arch)
        if spec is None:
            raise ValueError(f"GGUF {path} has architecture {arch!r}; supported architectures are {sorted(ARCHS)}")
        config = build_config(reader, arch, spec, path)
    with phase("dequantizing tensors", path):
        tensors, blocks = convert_tensors(reader, spec, config, path)
    if spec.model_type == "llama":
        config["attention_bias"] = complete_biases(tensors, config, ATTENTION_PROJECTIONS)
        config["mlp_bias"] = complete_biases(tensors, config, MLP_PROJECTIONS)
    with phase("writing safetensors", path):
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        for kind, tensors_of_kind in blocks.items():
            (out / BLOCKS_DIR).mkdir(exist_ok=True)
            save_file(tensors_of_kind, out / BLOCKS_DIR / f"{kind.lower()}.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    generation.update(sampling_recommendations(reader))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    with phase("converting tokenizer", path):
        save_tokenizer(reader, path, out, config["max_position_embeddings"])


def gguf_blocks(hf_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The GGUF blocks a converted directory keeps for its matmuls' weights: by kind (GGUF's name, "Q4_1"), by HF
    parameter name ({}: none)."""
    out = {}
    for kind in BLOCK_KINDS:
        path = Path(hf_dir) / BLOCKS_DIR / f"{kind.name.lower()}.safetensors"
        if path.is_file():
            with safe_open(path, framework="pt") as f:
                out[kind.name] = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not iterable
    return out


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    entry = reader.fields.get(key)
    if entry is None:
        if default is None:
            raise ValueError(f"GGUF {reader.data.filename} lacks the required metadata key {key!r}")
        return default
    return entry.contents()


def sampling_recommendations(reader: gguf.GGUFReader) -> dict[str, bool | float | int]:
    """The GGUF's `general.sampling.*` values under generation_config.json's names (floats are stored as float32:
    rounded back to 6 significant digits, so 0.6 reads 0.6), with `do_sample` as Hugging Face checkpoints that
    recommend sampling set it."""
    out: dict[str, bool | float | int] = {}
    for key, name in SAMPLING_KEYS.items():
        if key in reader.fields:
            value = field(reader, key)
            out[name] = int(value) if name == "top_k" else float(f"{float(value):.6g}")
    return {"do_sample": True, **out} if out else out


def build_config(reader: gguf.GGUFReader, arch: str, spec: ArchSpec, path: Path) -> dict[str, Any]:
    if field(reader, f"{arch}.expert_count", 0):
        raise ValueError(f"GGUF {path} is a mixture-of-experts {arch} model, which is not supported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"GGUF {path} has rope_freqs.weight (llama3-style rope scaling), which is not supported")
    hidden = int(field(reader, f"{arch}.embedding_length"))
    n_head = int(field(reader, f"{arch}.attention.head_count"))
    head_dim = int(field(reader, f"{arch}.attention.key_length", hidden // n_head))
    rotary_dim = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"GGUF {path} rotates {rotary_dim} of {head_dim} head dims; partial rotary is not supported")
    rope_theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_type = str(field(reader, f"{arch}.rope.scaling.type", "none"))
    if rope_type not in ("none", "linear"):
        raise ValueError(f"GGUF {path} uses rope scaling {rope_type!r}; supported: 'none', 'linear'")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_type == "linear":
        rope_parameters = {
            "rope_type": "linear",
            "rope_theta": rope_theta,
            "factor": float(field(reader, f"{arch}.rope.scaling.factor")),
        }
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None)
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": int(field(reader, f"{arch}.context_length")),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in reader.fields:
            config[f"{name.replace('padding', 'pad')}_token_id"] = int(field(reader, key))
    return config


def hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in TOP_LEVEL_NAMES:
        return TOP_LEVEL_NAMES[gguf_name]
    match = BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in BLOCK_NAMES:
        raise ValueError(f"GGUF {path} has tensor {gguf_name!r}, which has no Hugging Face counterpart")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{BLOCK_NAMES[part]}.{kind}"


def unpermute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute: per head, interleaved pairs back to two halves."""
    rows = weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
    return rows.swapaxes(1, 2).reshape(weights.shape)


def convert_tensors(
    reader: gguf.GGUFReader, spec: ArchSpec, config: dict[str, Any], path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The float32 tensors under their HF names, and by kind (GGUF's name) the blocks of the matmuls' weights
    that are Q4_0, Q4_1 or Q8_0 (rows as the float32 weight's): the projections' and the head's."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    head = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
    matmuls = {f"{p}.weight" for p in ATTENTION_PROJECTIONS + MLP_PROJECTIONS}
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in tqdm(reader.tensors, desc=f"Dequantizing {path.name}", unit="tensor"):
        name = hf_name(tensor.name, path)
        try:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF {path} tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                "which the gguf package cannot dequantize"
            ) from e
        weights = weights.reshape([int(d) for d in reversed(tensor.shape)])
        projection = name.split(".")[-2]
        matmul = tensor.tensor_type in BLOCK_KINDS and (name == head or name.split(".", 3)[-1] in matmuls)
        raw = np.asarray(tensor.data) if matmul else None
        if spec.permute_qk and projection in heads:
            weights = unpermute_rotary(weights, heads[projection])
            raw = None if raw is None else unpermute_rotary(raw, heads[projection])
        tensors[name] = torch.from_numpy(np.array(weights, dtype=np.float32))
        if raw is not None:
            matmul_name = "lm_head.weight" if name == head else name
            blocks.setdefault(tensor.tensor_type.name, {})[matmul_name] = torch.from_numpy(
                np.array(raw, dtype=np.uint8)
            )
    return tensors, blocks


def complete_biases(tensors: dict[str, torch.Tensor], config: dict[str, Any], projections: tuple[str, ...]) -> bool:
    """HF Llama biases all projections of a group or none: add zero biases where the GGUF has none."""
    prefixes = [f"model.layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in projections]
    if not any(f"{prefix}.bias" in tensors for prefix in prefixes):
        return False
    for prefix in prefixes:
        tensors.setdefault(f"{prefix}.bias", torch.zeros(tensors[f"{prefix}.weight"].shape[0]))
    return True


def save_tokenizer(reader: gguf.GGUFReader, path: Path, out: Path, max_length: int) -> None:
    from transformers import AutoTokenizer  # imported here: cache hits should not pay for transformers

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(out)
    saved = json.loads((out / "tokenizer_config.json").read_text())
    if "tokenizer.ggml.eos_token_id" in reader.fields:
        eos = reader.fields["tokenizer.ggml.tokens"].contents(int(field(reader, "tokenizer.ggml.eos_token_id")))
        if saved.get("eos_token") != eos:
            raise ValueError(f"tokenizer saved from {path} has eos {saved.get('eos_token')!r}, GGUF says {eos!r}")
    template_file = out / "chat_template.jinja"
    saved_template = template_file.read_text() if template_file.is_file() else saved.get("chat_template")
    if "tokenizer.chat_template" in reader.fields and saved_template != field(reader, "tokenizer.chat_template"):
        raise ValueError(f"tokenizer saved from {path} lost the GGUF's chat template")
