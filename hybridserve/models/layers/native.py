"""CPU kernels in C, built for the host at start-up and called through ctypes.

Stock PyTorch ops cannot read a paged KV cache in place: decode attention would first gather every
request's blocks into a dense buffer (a copy as large as the live KV, per layer and step) and then read
it back. `paged_decode.c` reads the blocks where they are. It is compiled once per
(source, compiler, CPU, head_dim, block_size, query heads per KV head) with the system C compiler (`$CC`,
default `cc`) into the cache directory, so later starts only load it (~1 ms); the first build takes about a
second. Without a working compiler the engine logs why and keeps the PyTorch path, which computes the same attention.

The library is linked with -fopenmp and loaded into a process where PyTorch already loaded its libgomp,
so both share one OpenMP runtime and thread count (`torch.set_num_threads` applies to the kernel too).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from hybridserve.paths import cache_dir

logger = logging.getLogger("hybridserve.engine")

_SOURCE = Path(__file__).with_name("paged_decode.c")
_FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fopenmp", "-fPIC", "-shared")
_ENTRY_POINTS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _I, _F]


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why."""


class PagedDecode:
    """Decode attention over a paged cache for one (dtype, head_dim, block_size, query heads per KV head),
    reading blocks in place."""

    def __init__(self, library: Path, dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> None:
        self.dtype, self.head_dim, self.block_size, self.group = dtype, head_dim, block_size, group
        self._fn = getattr(ctypes.CDLL(str(library)), _ENTRY_POINTS[dtype])
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = None

    def __call__(
        self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [B, Hq, D], rows may be strided (a slice of a wider projection) but each row contiguous;
        cache: [2, Hkv, num_blocks, block_size, D] contiguous; block_tables: [B, W] int64 contiguous;
        context_lens: [B] int64, tokens each query attends to. Returns [B, Hq, D]."""
        b, hq, d = q.shape
        if hq != self.group * cache.shape[1] or d != self.head_dim or cache.shape[3] != self.block_size:
            raise ValueError(
                f"kernel built for head_dim {self.head_dim}, block_size {self.block_size}, {self.group} query "
                f"heads per KV head; got q {tuple(q.shape)} and cache {tuple(cache.shape)}"
            )
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty((b, hq, d), dtype=q.dtype)
        self._fn(
            q.data_ptr(),
            q.stride(0),
            cache.data_ptr(),
            cache.shape[2],
            block_tables.data_ptr(),
            block_tables.stride(0),
            context_lens.data_ptr(),
            out.data_ptr(),
            b,
            hq,
            cache.shape[1],
            scale,
        )
        return out


def load_paged_decode(dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> PagedDecode:
    """The kernel for these shapes (`group`: query heads per KV head), built on first use. Raises
    KernelUnavailable naming the reason."""
    if dtype not in _ENTRY_POINTS:
        raise KernelUnavailable(f"no native paged-decode kernel for dtype {dtype} (only bfloat16 and float32)")
    return PagedDecode(_build(head_dim, block_size, group), dtype, head_dim, block_size, group)


def _build(head_dim: int, block_size: int, group: int) -> Path:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"C compiler {compiler!r} (from $CC, default cc) not found")
    defines = (f"-DHEAD_DIM={head_dim}", f"-DBLOCK_SIZE={block_size}", f"-DGROUP={group}")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(_FLAGS + defines).encode(), _compiler_version(compiler), _cpu_identity().encode()])
    ).hexdigest()[:16]
    root = cache_dir("kernels")
    library = root / f"paged_decode-d{head_dim}-b{block_size}-g{group}-{key}.so"
    if library.is_file():
        return library
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=f".{library.name}.", dir=root)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_FLAGS, *defines, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build {_SOURCE.name}: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, library)  # atomic: a concurrent start sees the old state or a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s in %.1f s", library.name, time.perf_counter() - start)
    return library


def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, check=False, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"C compiler {compiler!r} does not run: {exc}") from exc


def _cpu_identity() -> str:
    """The machine and its instruction-set flags: a -march=native library is only valid on the same CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}\0{flags}"
