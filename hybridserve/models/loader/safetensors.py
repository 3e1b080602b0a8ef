"""Read a Hugging Face model directory: config.json and its (possibly sharded) safetensors weights.

`load_state_dict` reads the whole checkpoint, or with a `Shard` of size above 1 one tensor- / expert-parallel
rank's part of it as the model's shard plan says (loader/sharding.py): each split tensor through safetensors'
`get_slice`, so that no rank reads or holds more of a tensor than its slice. Names stay the checkpoint's;
the caller adapts and packs them per rank as for a whole load (q, k, v each split by heads, then packed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hybridserve.models.loader.sharding import Shard, ShardPlan

INDEX_FILE = "model.safetensors.index.json"


def load_config(hf_dir: Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {hf_dir} has no config.json")
    return json.loads(path.read_text())


def weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [hf_dir / shard for shard in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that do not exist: {missing}")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {hf_dir} has no *.safetensors files")
    return files


def load_state_dict(
    hf_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    fp32_suffixes: tuple[str, ...] = (),
    shard: Shard | None = None,
    plan: ShardPlan | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the directory on `device`; floating-point tensors are cast to `dtype`, except those
    whose names end with one of `fp32_suffixes`, which become float32. With a `shard` of size above 1, only
    that rank's slice of each tensor as `plan` says, and none of the experts other ranks hold."""
    if shard is not None and not shard.whole:
        if plan is None:
            raise ValueError(f"loading shard {shard} of {hf_dir} needs the model's shard plan")
        return _load_shard(Path(hf_dir), dtype, device, fp32_suffixes, shard, plan)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(Path(hf_dir)):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name in state:
                    raise ValueError(f"tensor {name!r} appears in more than one shard of {hf_dir} (again in {file})")
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.float() if name.endswith(fp32_suffixes) else tensor.to(dtype)
                state[name] = tensor
    return state


def _load_shard(
    hf_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    fp32_suffixes: tuple[str, ...],
    shard: Shard,
    plan: ShardPlan,
) -> dict[str, torch.Tensor]:
    """One rank's part: every tensor's shape from the headers first (so that a tensor without a rule, or one
    that does not divide, fails before any data is read), then each slice read from the host mapping of the
    file and moved to `device` alone."""
    files = weight_files(hf_dir)
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name in shapes:
                    raise ValueError(f"tensor {name!r} appears in more than one shard of {hf_dir} (again in {file})")
                shapes[name] = f.get_slice(name).get_shape()
    indices = plan.indices(shapes, shard)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name not in indices:
                    continue
                index = indices[name]
                tensor = f.get_slice(name)[index] if index else f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(device, torch.float32 if name.endswith(fp32_suffixes) else dtype)
                state[name] = tensor.to(device).contiguous()
    return state


def pack(
    state: dict[str, torch.Tensor], packed_modules: dict[str, tuple[str, ...]], partial: bool = False
) -> dict[str, torch.Tensor]:
    """Concatenate checkpoint projections into the fused modules a model computes with, e.g.
    `*.q_proj.weight`, `*.k_proj.weight`, `*.v_proj.weight` → `*.qkv_proj.weight` (rows in that order).
    A fused tensor whose parts are not all there raises, or with `partial` is left out with its parts."""
    out = dict(state)
    for fused, parts in packed_modules.items():
        suffix = f".{parts[0]}."
        for name in [n for n in state if suffix in n]:
            prefix, param = name.split(suffix, 1)
            names = [f"{prefix}.{part}.{param}" for part in parts]
            missing = [n for n in names if n not in state]
            if missing and not partial:
                raise ValueError(f"cannot build {prefix}.{fused}.{param}: checkpoint lacks {missing}")
            if not missing:
                out[f"{prefix}.{fused}.{param}"] = torch.cat([out.pop(n) for n in names])
        if partial:  # the parts of those that could not be built
            for name in [n for n in out if any(f".{part}." in n for part in parts)]:
                del out[name]
    return out
