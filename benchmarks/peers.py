"""vLLM's CPU build as the side-by-side benchmarks start it: interpreter, environment, model arguments.

../shared/bench/peer-vllm.sh installs the build under $PEER_ROOT (default /tmp/peer) and makes the HF copy of
the default model; it serves in bfloat16 only, which on a CPU without native bf16 matmuls (AVX2 without
AVX512-BF16) makes no progress. So the benchmarks start vLLM's modules themselves, with the environment that
script sets and, unless told otherwise, the dtype hybridserve's `--dtype auto` picks on this machine: the same
precision on both sides.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
from report import say

from hybridserve.engine.model_runner import choose_dtype

MODEL = "smollm2"


def same_dtype_as_engine() -> str:
    """The dtype `--dtype auto` picks for the engine on this CPU, by vLLM's name for it."""
    return str(choose_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def vllm_env(peer_root: Path) -> dict[str, str]:
    """peer-vllm.sh's environment: offline, a 2 GiB KV cache, OpenMP bound to every core, none reserved."""
    cores = os.cpu_count() or 1
    env = dict(os.environ)
    env.update(
        VLLM_CACHE_ROOT=str(peer_root / "vllm_cache"),
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        OMP_NUM_THREADS=str(cores),
    )
    return env


def vllm_command(peer_root: Path, module: str, dtype: str) -> list[str]:
    """`python -m <module>` on the default model in `dtype`. The module, not the `vllm` script: that one asks
    for the "vllm" distribution's version, and the CPU build is installed as "vllm-cpu" (PackageNotFoundError)."""
    python = str(peer_root / "vllm" / "bin" / "python")
    model = ["--model", str(peer_root / "model_hf"), "--served-model-name", MODEL]
    return [python, "-m", module, *model, "--dtype", dtype, "--max-model-len", "4096"]


def vllm_missing(peer_root: Path, bench_dir: Path) -> str | None:
    """Why vLLM cannot run here, or None; its model copy is made on first use (peer-model.sh)."""
    python = peer_root / "vllm" / "bin" / "python"
    if not python.is_file():
        return f"vLLM is not installed ({python} not found; `bash {bench_dir / 'peer-vllm.sh'}` installs it)"
    if not (peer_root / "model_hf" / "config.json").is_file():
        say("vllm: making the HF copy of the model (peer-model.sh)")
        env = {**os.environ, "PEER_ROOT": str(peer_root)}
        subprocess.run(["bash", str(bench_dir / "peer-model.sh"), str(python)], check=True, env=env)
    return None
