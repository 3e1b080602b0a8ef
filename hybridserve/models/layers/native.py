"""CPU kernels in C, built for the host at start-up and called through ctypes.

Stock PyTorch ops cannot read a paged KV cache in place: decode attention would first gather every
request's blocks into a dense buffer (a copy as large as the live KV, per layer and step) and then read
it back. The paged_attention library reads the blocks where they are, and rotates a step's queries and keys
while writing its keys and values into the cache. fused_ops does a layer's element-wise chains (residual
add + RMSNorm, SiLU-and-multiply) in one pass each instead of up to nine small ops, and the greedy argmax
over the logits on all threads (PyTorch's takes ~8 ms for 64 rows of 49152 on one). kda_decode steps
Kimi Delta Attention's recurrent states in place in the state pool, instead of gathering them, updating
them in a dozen batched ops and scattering them back. LIBRARIES names each library's sources, one file per
kernel family (docs/kernels.md).

Each library is compiled once per (its sources and the headers they include, compiler, CPU, compile-time shape)
with the system C compiler (`$CC`, default `cc`) into the cache directory, so later starts only load it
(~1 ms); a first build takes 0.5-2 s a library. Without a working compiler the engine logs why and
keeps the PyTorch ops, which compute the same thing.

The C functions a library exports are marked EXPORT in its sources (cpu_math.h), and their ctypes signatures come
from those prototypes (signatures()): a kernel's signature is written once, in C.

The libraries are linked with -fopenmp and loaded into a process where PyTorch already loaded its libgomp,
so all share one OpenMP runtime and thread count (`torch.set_num_threads` applies to the kernels too).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from hybridserve.paths import cache_dir

logger = logging.getLogger("hybridserve.engine")

_HERE = Path(__file__).parent
# -fno-trapping-math: no kernel reads the floating-point exception flags, and with them kept GCC leaves every loop
# with a clamp or select unvectorised (exp_approx's, so SiLU ran a lane at a time); results are unchanged.
# -fvisibility=hidden: a library exports its EXPORT functions only (cpu_math.h).
_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-trapping-math",
    "-std=gnu11",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
)
# The instruction-set levels the kernels have variants for, lowest first: the CPU flags (/proc/cpuinfo's names) a host
# needs for a level on top of the levels below it, and the compiler flags that turn off everything above the level in
# a -march=native build. $HYBRIDSERVE_MAX_CPU_ISA caps the build at a level (as oneDNN's ONEDNN_MAX_CPU_ISA does),
# so one host runs the variants of the hosts below it; cpu_math.h's BUILT_ISA names the level a library was built for.
ISA_LEVELS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-mno-avx512f", "-mno-amx-tile")),
    "avx512": (
        frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"}),
        ("-mno-avx512bf16", "-mno-avx512vnni", "-mno-amx-tile"),
    ),
    "avx512_bf16": (frozenset({"avx512_bf16", "avx512_vnni"}), ("-mno-amx-tile",)),
    "amx": (frozenset({"amx_tile", "amx_bf16"}), ()),
}
MAX_ISA_VARIABLE = "HYBRIDSERVE_MAX_CPU_ISA"
_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

# The kernel libraries and their sources (in this directory), one file per kernel family. A library is compiled as
# one translation unit of its sources, in this order (a file that #includes them): the compiler sees the library
# whole, as it saw the single file each once was, so it inlines and allocates registers as it did then.
LIBRARIES: dict[str, tuple[str, ...]] = {
    "linear": ("linear_f32.c", "linear_blocks.c", "greedy_head.c", "linear_bf16.c", "linear_amx.c"),
    "paged_attention": ("paged_decode_bf16.c", "paged_decode.c", "rope_write_kv.c", "paged_prefill.c"),
    "fused_ops": ("fused_ops.c",),
    "kda_decode": ("kda_decode.c",),
    "decoder_stack": ("decoder_stack.c",),
}


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why."""


class BindingError(RuntimeError):
    """The Python side asks for a C function its library's sources do not declare EXPORT, or declare in a form the
    signature parser does not read: a bug, never a reason to fall back to the PyTorch ops."""


class Signature(NamedTuple):
    """An EXPORT function's ctypes types, as its prototype in `source` gives them."""

    name: str
    restype: type | None
    argtypes: tuple[type, ...]
    source: str


# C types of a kernel's parameters and results (pointers of any type: c_void_p; char pointers: c_char_p).
_C_TYPES: dict[str, type | None] = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "unsigned": ctypes.c_uint,
    "unsigned int": ctypes.c_uint,
    "uint32_t": ctypes.c_uint32,
    "long": ctypes.c_int64,
    "long long": ctypes.c_int64,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_QUALIFIERS = frozenset({"const", "volatile", "restrict", "__restrict", "__restrict__"})
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
# preprocessor lines with their continuations: a macro's body declares nothing (macro-made functions have prototypes)
_DIRECTIVE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.MULTILINE)
_EXPORT = re.compile(r"\bEXPORT\b")
_PROTOTYPE = re.compile(r"\bEXPORT\s+([\w\s*]*?)\b(\w+)\s*\(([^()]*)\)\s*[;{]")


def _ctype(declaration: str, named: bool, where: str) -> type | None:
    """The ctypes type of a C parameter (`named`: it may end in a name) or result type."""
    words = [w for w in re.findall(r"\w+", declaration) if w not in _QUALIFIERS]
    if "*" in declaration or "[" in declaration:
        return ctypes.c_char_p if words[:1] == ["char"] else ctypes.c_void_p
    for type_words in (words, words[:-1]) if named else (words,):
        if type_words and " ".join(type_words) in _C_TYPES:
            return _C_TYPES[" ".join(type_words)]
    raise BindingError(f"{where}: C type {declaration.strip()!r} has no ctypes mapping here (native._C_TYPES)")


def parse_prototypes(text: str, source: str = "<string>") -> dict[str, Signature]:
    """The EXPORT functions a C source declares or defines, by name. A function declared more than once (in the
    branches of an #if) must have the same types each time. Raises BindingError for an EXPORT it cannot read."""
    text = _DIRECTIVE.sub("", _COMMENT.sub(" ", text))
    found: dict[str, Signature] = {}
    matches = list(_PROTOTYPE.finditer(text))
    if len(matches) != len(_EXPORT.findall(text)):
        parsed = {m.start() for m in matches}
        at = next(m.start() for m in _EXPORT.finditer(text) if m.start() not in parsed)
        raise BindingError(f"{source}: cannot read the EXPORT declaration at {text[at : at + 80]!r}")
    for match in matches:
        result, name, parameters = match.groups()
        where = f"{source}: {name}"
        params = [p for p in parameters.split(",") if p.strip()]
        if [p.strip() for p in params] == ["void"]:
            params = []
        signature = Signature(name, _ctype(result, False, where), tuple(_ctype(p, True, where) for p in params), source)
        if name in found and found[name][1:3] != signature[1:3]:
            raise BindingError(f"{where} is declared EXPORT twice with different types")
        found[name] = signature
    return found


@functools.cache
def signatures(source_or_library: str) -> dict[str, Signature]:
    """The EXPORT functions of a kernel source (a file name in this directory, or a path) or of a library of
    LIBRARIES (all its sources'), by name. Raises BindingError where two sources of a library declare one name."""
    if source_or_library in LIBRARIES:
        merged: dict[str, Signature] = {}
        for source in LIBRARIES[source_or_library]:
            for name, signature in signatures(source).items():
                if name in merged and merged[name].source != signature.source:
                    first = merged[name].source
                    raise BindingError(f"{name} is declared EXPORT in both {first} and {signature.source}")
                merged[name] = signature
        return merged
    path = Path(source_or_library) if os.sep in source_or_library else _HERE / source_or_library
    return parse_prototypes(path.read_text(), path.name)


class _Library:
    """A built library, its functions bound by their EXPORT prototypes."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path, self._lib = name, path, ctypes.CDLL(str(path))

    def __call__(self, function: str) -> Callable[..., Any]:
        signature = signatures(self.name).get(function)
        if signature is None:
            raise BindingError(
                f"{function}() is not declared EXPORT in the {self.name} library's sources "
                f"({', '.join(LIBRARIES[self.name])}, in {_HERE})"
            )
        try:
            fn = getattr(self._lib, function)
        except AttributeError:
            raise BindingError(
                f"{function}() is declared EXPORT in {signature.source} but {self.path.name} does not export it "
                f"(not built for this CPU, or defined without EXPORT)"
            ) from None
        fn.argtypes, fn.restype = list(signature.argtypes), signature.restype
        return fn


class PagedAttention:
    """Paged-cache kernels for one (dtype, head_dim, block_size, query heads per KV head)."""

    def __init__(self, library: Path, dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> None:
        self.dtype, self.head_dim, self.block_size, self.group = dtype, head_dim, block_size, group
        lib, name = _Library("paged_attention", library), _DTYPES[dtype]
        self._decode = lib(f"paged_decode_{name}")
        self._rope_write_kv = lib(f"rope_write_kv_{name}")
        # Whether bfloat16 key scores use the CPU's bf16 dot-product instructions (AVX512-BF16).
        self.bf16_dot = dtype == torch.bfloat16 and bool(lib("paged_decode_bf16_dot")())
        # Whether prefill chunks attend natively too (16-token blocks; bfloat16 with its dot products); else SDPA.
        if dtype == torch.bfloat16:
            self.prefills = self.bf16_dot and bool(lib("paged_prefill_available")())
        else:
            self.prefills = bool(lib("paged_prefill_f32_available")())
        if self.prefills:
            self._prefill = lib(f"paged_prefill_{name}")

    def _check(self, q_heads: int, cache: torch.Tensor) -> None:
        if q_heads != self.group * cache.shape[1] or cache.shape[3:] != (self.block_size, self.head_dim):
            raise ValueError(
                f"kernel built for head_dim {self.head_dim}, block_size {self.block_size}, {self.group} query "
                f"heads per KV head; got {q_heads} query heads and cache {tuple(cache.shape)}"
            )

    def decode(
        self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One query per request, over its cached keys. q: [B, Hq, D], rows may be strided (a slice of a
        wider projection) but each row contiguous; cache: [2, Hkv, num_blocks, block_size, D] contiguous;
        block_tables: [B, W] int64 contiguous; context_lens: [B] int64, keys each query sees. Returns
        [B, Hq, D]."""
        b, hq, d = q.shape
        self._check(hq, cache)
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty((b, hq, d), dtype=q.dtype)
        self._decode(
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

    def prefill(
        self, q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scale: float
    ) -> torch.Tensor:
        """A chunk of one request, causal, over its cached keys (the chunk's own written already). q: [n, Hq, D],
        rows may be strided but each row contiguous; block_table: [W] int64 contiguous, covering context_len + n
        tokens; context_len: the request's tokens before the chunk. Returns [n, Hq, D]. Only where `prefills`."""
        n, hq, d = q.shape
        self._check(hq, cache)
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        if block_table.numel() * self.block_size < context_len + n:
            raise ValueError(
                f"block table of {block_table.numel()} blocks cannot hold {context_len} + {n} tokens of a prefill"
            )
        out = torch.empty((n, hq, d), dtype=q.dtype)
        status = self._prefill(
            q.data_ptr(),
            q.stride(0),
            cache.data_ptr(),
            cache.shape[2],
            block_table.data_ptr(),
            context_len,
            n,
            out.data_ptr(),
            hq,
            cache.shape[1],
            scale,
        )
        if status != 0:
            raise MemoryError(f"prefill attention found no memory to unpack {context_len + n} tokens of KV")
        return out

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        q_heads: int,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Rotate queries and keys of qkv ([T, Hq + 2 * Hkv, D], each token's heads contiguous) in place
        and write keys and values to their cache slots ([T] int64). cos_sin: rope.py's tables, [T, 1, D]."""
        t, heads, d = qkv.shape
        self._check(q_heads, cache)
        if qkv.stride(2) != 1 or qkv.stride(1) != d or heads != q_heads + 2 * cache.shape[1]:
            raise ValueError(
                f"qkv must hold {q_heads} query heads then keys and values, rows contiguous; got "
                f"shape {tuple(qkv.shape)}, strides {qkv.stride()}"
            )
        cos, sin = cos_sin
        self._rope_write_kv(
            qkv.data_ptr(),
            t,
            qkv.stride(0),
            q_heads,
            cache.shape[1],
            cos.data_ptr(),
            sin.data_ptr(),
            cache.data_ptr(),
            cache.shape[2],
            slots.data_ptr(),
        )


class FusedOps:
    """A decoder layer's element-wise chains in one pass each, and the logits' argmax, for bfloat16 and float32
    rows."""

    def __init__(self, library: Path) -> None:
        lib = _Library("fused_ops", library)
        self._add_rms_norm = {dtype: lib(f"add_rms_norm_{name}") for dtype, name in _DTYPES.items()}
        self._silu_mul = {dtype: lib(f"silu_mul_{name}") for dtype, name in _DTYPES.items()}
        self._argmax = {dtype: lib(f"argmax_{name}") for dtype, name in _DTYPES.items()}

    def supports(self, *tensors: torch.Tensor) -> bool:
        """Whether the kernels can take these tensors: CPU, contiguous, all bfloat16 or all float32."""
        dtype = tensors[0].dtype
        return dtype in _DTYPES and all(
            t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors
        )

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta in place (skipped when delta is None); returns RMSNorm(residual) * weight.
        All [rows, dim] contiguous tensors of one dtype."""
        rows, dim = residual.shape
        out = torch.empty_like(residual)
        self._add_rms_norm[residual.dtype](
            residual.data_ptr(),
            0 if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * dim] contiguous, gate first. Returns silu(gate) * up, [rows, dim]."""
        rows, width = gate_up.shape
        out = gate_up.new_empty((rows, width // 2))
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def can_argmax(self, x: torch.Tensor) -> bool:
        """Whether argmax takes x: [rows, n] on CPU, bfloat16 or float32, each row contiguous."""
        return x.dim() == 2 and x.dtype in _DTYPES and x.device.type == "cpu" and (x.stride(1) == 1 or x.shape[1] <= 1)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of [rows, n] logits (rows may be strided, each contiguous), as int64."""
        if not self.can_argmax(x):
            raise ValueError(f"argmax needs CPU bfloat16 or float32 rows, got {x.dtype} {tuple(x.shape)} on {x.device}")
        rows, n = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax[x.dtype](x.data_ptr(), x.stride(0), rows, n, out.data_ptr())
        return out


class _ArgmaxKernels(NamedTuple):
    """One dtype's greedy-head functions (greedy_head.c) and the layout of its int8 copy: panels of 16 weight rows,
    the rows padded to `rows`, K in groups of `k_group`; `meta_rows` per-row values (scale, error norm, norm,
    and for bf16 the sum of its int8 values)."""

    available: Callable[[int], int]  # nonzero: it takes an inner size k
    pack: Callable[..., int]
    workspace: Callable[..., int]
    argmax: Callable[..., int]
    rows: int
    k_group: int
    meta_rows: int


# GGUF block formats the float32 matmuls read in place: linear_blocks.h's code for the kind, bytes per 32 weights, the
# panels it is packed into (Q4_0's d (q - 8) is Q4_1's d q + m with m = -8 d, exactly)
BLOCKS = {"Q4_1": (0, 20, "q4_1"), "Q8_0": (1, 34, "q8_0"), "Q4_0": (2, 18, "q4_1")}


class LinearKernels:
    """Matmuls y = x W^T + b over weights packed once into panels (the linear library: linear_f32.c, GGUF blocks
    linear_blocks.c): float32 everywhere, bfloat16 where the CPU has AVX512-BF16 (linear_bf16.c; summed on AMX's tiles
    where it has those too, linear_amx.c), and the greedy head (greedy_head.c)."""

    def __init__(self, library: Path) -> None:
        lib = _Library("linear", library)
        # the level of ISA_LEVELS the library was built for ("baseline" below them all)
        self.isa: str = lib("linear_isa")().decode()
        self.panel_width = {torch.float32: int(lib("linear_panel_width")())}
        if bf16_width := int(lib("linear_bf16_panel_width")()):
            self.panel_width[torch.bfloat16] = bf16_width
        self.amx = bool(lib("linear_amx_init")())
        self._pack = {torch.float32: lib("linear_pack_f32")}
        self._linear = {torch.float32: lib("linear_f32")}
        # float32 matmuls over weights kept in GGUF blocks (their panels: uint8), by GGUF's name for the format
        self._linear_blocks = {kind: lib(f"linear_{panels}_f32") for kind, (_, _, panels) in BLOCKS.items()}
        # float32 matmuls gated by SiLU (a gate panel, then the up panel of the same columns), by block kind or None
        gated_names = {None: "linear_f32_silu"} | {kind: f"linear_{p}_f32_silu" for kind, (_, _, p) in BLOCKS.items()}
        self._linear_silu = {kind: lib(name) for kind, name in gated_names.items()}
        self._pack_blocks = lib("linear_pack_blocks")
        group_bytes = lib("linear_blocks_group_bytes")
        self._group_bytes = {kind: int(group_bytes(code)) for kind, (code, _, _) in BLOCKS.items()}
        if torch.bfloat16 in self.panel_width:
            self._pack[torch.bfloat16] = lib("linear_pack_bf16")
            self._linear[torch.bfloat16] = lib("linear_bf16")
        # the greedy head (argmax): bf16 with AVX512-VNNI, float32 with AVX2 (FMA, F16C)
        self._argmax: dict[torch.dtype, _ArgmaxKernels] = {}
        for dtype, suffix, rows, k_group, meta_rows in (
            (torch.bfloat16, "", 32, 4, 4),
            (torch.float32, "_f32", 16, 2, 3),
        ):
            available = lib(f"linear_argmax{suffix}_available")
            if available(1):
                self._argmax[dtype] = _ArgmaxKernels(
                    available,
                    lib(f"linear_argmax{suffix}_pack"),
                    lib(f"linear_argmax{suffix}_workspace"),
                    lib(f"linear_argmax{suffix}"),
                    rows,
                    k_group,
                    meta_rows,
                )
        self._argmax_work = torch.empty(0, dtype=torch.uint8)

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(self.panel_width)

    def describe(self, dtype: torch.dtype) -> str:
        width = self.panel_width[dtype]
        how = {torch.float32: "float32", torch.bfloat16: "bfloat16 on AMX" if self.amx else "bfloat16 (AVX512-BF16)"}
        return f"native {how[dtype]} kernels (panels of {width} columns)"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight: [N, K] on CPU, a dtype of `dtypes`. Returns its panels: float32 [ceil(N / width), K, width],
        bfloat16 [ceil(N / width), ceil(K / 2), width, 2]."""
        if weight.dtype not in self.panel_width or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(
                f"packing needs a 2-D CPU weight of {', '.join(map(str, self.dtypes))}, got {weight.dtype} "
                f"{tuple(weight.shape)} on {weight.device}"
            )
        weight = weight.contiguous()
        n, k = weight.shape
        width = self.panel_width[weight.dtype]
        shape = (-(-n // width), k, width) if weight.dtype == torch.float32 else (-(-n // width), -(-k // 2), width, 2)
        packed = torch.empty(shape, dtype=weight.dtype)
        self._pack[weight.dtype](weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def pack_blocks(self, weight: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor | None:
        """Panels of a float32 weight [N, K] from its GGUF blocks of `kind` (a key of BLOCKS; uint8 [N, K / 32 *
        block bytes], rows in the weight's order): uint8 [ceil(N / width), K / 32, group bytes], 19% (Q4_1, Q4_0) or
        28% (Q8_0) of the float32 panels' bytes, which linear(..., blocks=kind) sums bitwise as it sums
        pack(weight). None if the blocks do not give the weight bitwise."""
        n, k = weight.shape
        code, block, _ = BLOCKS[kind]
        if (
            weight.dtype != torch.float32
            or blocks.dtype != torch.uint8
            or k % 32
            or blocks.shape != (n, k // 32 * block)
        ):
            raise ValueError(
                f"{kind} blocks of a float32 weight [N, K] (K a multiple of 32) are uint8 [N, K / 32 * {block}]; got "
                f"weight {weight.dtype} {tuple(weight.shape)}, blocks {blocks.dtype} {tuple(blocks.shape)}"
            )
        width = self.panel_width[torch.float32]
        packed = torch.empty((-(-n // width), k // 32, self._group_bytes[kind]), dtype=torch.uint8)
        weight, blocks = weight.contiguous(), blocks.contiguous()
        mismatches = self._pack_blocks(code, blocks.data_ptr(), weight.data_ptr(), n, k, packed.data_ptr())
        return packed if mismatches == 0 else None

    def pack_gated(self, weight: torch.Tensor) -> torch.Tensor:
        """The rows of a SiLU-gated MLP's [gate; up] weight [2 I, ...] (or its bias [2 I], or its GGUF blocks [2 I,
        bytes]) in the order linear(..., gated=True) takes them after packing: per panel of float32 columns, that
        panel's gate rows, then its up rows, each padded with zero rows to the panel's width."""
        width, inter = self.panel_width[torch.float32], weight.shape[0] // 2
        if weight.shape[0] != 2 * inter:
            raise ValueError(f"a gated weight has [gate; up] rows, an even count; got {tuple(weight.shape)}")
        panels, rest = -(-inter // width), weight.shape[1:]
        gate, up = (F.pad(half, (0, 0) * len(rest) + (0, panels * width - inter)) for half in weight.split(inter))
        return torch.stack((gate.view(panels, width, *rest), up.view(panels, width, *rest)), 1).flatten(0, 2)

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        float_out: bool = False,
        blocks: str | None = None,
        gated: bool = False,
    ) -> torch.Tensor:
        """x: [M, K] of packed's dtype (float32 for block panels), each row contiguous; packed: pack()'s panels of W
        [n, K], or with `blocks` pack_blocks()'s of that kind; bias: [n] float32 or None. Returns [M, n] in x's
        dtype, or with float_out in float32, the sums unrounded. gated (float32): W is a SiLU-gated MLP's [gate; up]
        weight [2 n, K] in pack_gated's order (its bias too, [2 n] padded), and the result silu(gate) * up [M, n],
        bitwise FusedOps.silu_mul of the plain matmul's output."""
        m, k = x.shape
        dtype = torch.float32 if blocks is not None else packed.dtype
        # bf16 panels hold k in pairs, block ones in groups of 32 (no K but a multiple of 32 matches them)
        if blocks is not None:
            packed_k = k // 32 if k % 32 == 0 else -1
        else:
            packed_k = k if packed.dtype == torch.float32 else -(-k // 2)
        if x.dtype != dtype or packed_k != packed.shape[1] or (x.stride(1) != 1 and m > 0):
            raise ValueError(
                f"input must be {dtype} [M, K] with K the weight's ({packed.dtype} panels "
                f"{tuple(packed.shape)}) and contiguous rows, got {x.dtype} {tuple(x.shape)} with strides {x.stride()}"
            )
        width = self.panel_width[dtype]
        columns = 2 * -(-n // width) * width if gated else n  # a gated weight's padded gate and up columns
        if gated and (dtype != torch.float32 or packed.shape[0] * width != columns):
            raise ValueError(
                f"a gated matmul takes float32 panels of pack_gated's [gate; up] rows ({columns // width} panels for "
                f"{n} outputs), got {packed.dtype} panels {tuple(packed.shape)}"
            )
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (columns,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous float32 [{columns}], got {bias.dtype} {tuple(bias.shape)}")
        y = torch.empty((m, n), dtype=torch.float32 if float_out else x.dtype)
        if m:
            args = [x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), n, 0 if bias is None else bias.data_ptr()]
            if x.dtype == torch.bfloat16:
                self._linear[x.dtype](*args, y.data_ptr(), int(float_out))
            else:
                self.function(packed, blocks, gated)(*args, y.data_ptr())
        return y

    def function(self, packed: torch.Tensor, blocks: str | None = None, gated: bool = False) -> Callable[..., None]:
        """The C function linear() calls for these panels (decoder_stack.c calls it directly)."""
        if gated:
            return self._linear_silu[blocks]
        return self._linear[packed.dtype] if blocks is None else self._linear_blocks[blocks]

    def can_argmax(self, weight: torch.Tensor) -> bool:
        """Whether argmax takes this weight [N, K]: bf16 with AVX512-VNNI, where linear() sums it with
        AVX512-BF16 (not on AMX's tiles, whose order argmax's exact logits do not follow), and small enough for
        the 32-bit word offsets its candidates' rows are gathered by; float32 with AVX2, FMA and F16C."""
        if weight.dtype not in self._argmax or weight.dtype not in self.panel_width or weight.dim() != 2:
            return False
        n, k = weight.shape
        gathered_by_words = weight.dtype == torch.bfloat16  # its candidates' rows: 32-bit word offsets
        return bool(self._argmax[weight.dtype].available(k)) and not (gathered_by_words and n * -(-k // 2) >= 2**31)

    def pack_argmax(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 copy of a weight [N, K] that argmax bounds its logits with, and per row its scale, error norm
        and norm (bf16: and the sum of its int8 values). bf16: panels of 16 rows, whole pairs of them,
        [ceil(N / 32) * 2, ceil(K / 4), 16, 4], meta [4, ceil(N / 32) * 32]; float32: panels of 16 rows in pairs
        of K, [ceil(N / 16), ceil(K / 2), 16, 2], meta [3, ceil(N / 16) * 16]."""
        if not self.can_argmax(weight):
            raise ValueError(f"argmax cannot take the weight {weight.dtype} {tuple(weight.shape)} on this CPU")
        weight = weight.contiguous()
        n, k = weight.shape
        kernels = self._argmax[weight.dtype]
        rows = -(-n // kernels.rows) * kernels.rows
        q = torch.empty((rows // 16, -(-k // kernels.k_group), 16, kernels.k_group), dtype=torch.int8)
        meta = torch.empty((kernels.meta_rows, rows), dtype=torch.float32)
        if kernels.pack(weight.data_ptr(), n, k, q.data_ptr(), meta.data_ptr()) != 0:
            raise ValueError(f"the weight {tuple(weight.shape)} holds a non-finite value: its logits have no bound")
        return q, meta

    def argmax(
        self, x: torch.Tensor, weight: torch.Tensor, q: torch.Tensor, meta: torch.Tensor, n: int
    ) -> torch.Tensor:
        """Each row's argmax over the first n columns of linear(x, pack(weight), ..., float_out=True) (the first
        largest), as int64, with only the logits that could be the largest computed, bitwise as linear() sums
        them; -1 for a row it cannot tell so cheaper than the full row (a non-finite x, or an eighth of the
        columns candidates: nearly flat logits). x: [M, K] of the weight's dtype, rows contiguous; weight: [N, K]
        contiguous (n <= N); q, meta: pack_argmax(weight)."""
        m, k = x.shape
        kernels = self._argmax.get(weight.dtype)
        if (
            kernels is None
            or x.dtype != weight.dtype
            or x.stride(1) != 1
            or weight.shape[1] != k
            or not weight.is_contiguous()
            or q.shape[1] != -(-k // kernels.k_group)
            or not 0 < n <= weight.shape[0]
        ):
            raise ValueError(
                f"argmax needs rows [M, K] of the weight's dtype and K and 0 < n <= its rows, got {x.dtype} "
                f"{tuple(x.shape)} strides {x.stride()}, n {n}, weight {weight.dtype} {tuple(weight.shape)}"
            )
        out = torch.empty(m, dtype=torch.int64)
        if m:
            size = kernels.workspace(m, n, k)
            if self._argmax_work.numel() < size:
                self._argmax_work = torch.empty(size, dtype=torch.uint8)
            args = [x.data_ptr(), x.stride(0), m, k, q.data_ptr(), meta.data_ptr(), meta.shape[1], weight.data_ptr()]
            kernels.argmax(*args, n, self._argmax_work.data_ptr(), out.data_ptr())
        return out


class KDADecode:
    """The KDA decode step (kda.kda_recurrent) for one head_dim, on the state pool's slots in place."""

    def __init__(self, library: Path, head_dim: int) -> None:
        self.head_dim = head_dim
        self._decode = _Library("kda_decode", library)("kda_decode_f32")

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request, all float32 on CPU. q, k, v, g: [B, H, d], rows may be strided (q, k, v
        are views of the convolution's output) but each row's heads contiguous; beta: [B, H]; states: the
        pool's [slots, H, d, d] contiguous, updated in place at `slots` ([B] int64, distinct). q is already
        scaled. Returns o: [B, H, d]."""
        b, h, d = q.shape
        shapes = (k.shape, v.shape, g.shape, beta.shape, states.shape[1:], slots.shape)
        if d != self.head_dim or shapes != ((b, h, d),) * 3 + ((b, h), (h, d, d), (b,)):
            raise ValueError(
                f"kernel built for head_dim {self.head_dim}; got q {tuple(q.shape)}, k, v, g, beta, states[1:], "
                f"slots {[tuple(x) for x in shapes]}"
            )
        if not states.is_contiguous() or slots.dtype != torch.int64 or slots.device.type != "cpu":
            raise ValueError(
                f"states must be contiguous and slots int64 on CPU, got strides {states.stride()}, slots "
                f"{slots.dtype} on {slots.device}"
            )
        q, k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (q, k, v))
        g, beta, slots = g.contiguous(), beta.contiguous(), slots.contiguous()
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("states", states)):
            if x.dtype != torch.float32 or x.device.type != "cpu":
                raise ValueError(f"{name} must be float32 on CPU, got {x.dtype} on {x.device}")
        out = torch.empty((b, h, d), dtype=torch.float32)
        bad = self._decode(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            g.data_ptr(),
            beta.data_ptr(),
            states.data_ptr(),
            states.shape[0],
            slots.data_ptr(),
            out.data_ptr(),
            b,
            h,
        )
        if bad >= 0:
            raise ValueError(f"state slot {slots[bad].item()} (row {bad}) is outside the pool's {states.shape[0]}")
        return out


class _StackLayer(ctypes.Structure):
    """decoder_stack.c's per-layer record."""

    _fields_ = [
        *((name, _P) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")),
        *((name, _P) for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "cache")),
        ("num_blocks", _I),
        *((name, _P) for name in ("qkv_linear", "o_linear", "gate_up_linear", "down_linear")),
    ]


class _Stack(ctypes.Structure):
    """decoder_stack.c's stack record: the kernels it calls, the model's shapes, its layers."""

    _fields_ = [
        *((name, _P) for name in ("add_rms_norm", "silu_mul", "rope_write_kv", "decode")),
        *((name, _I) for name in ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "intermediate")),
        ("eps", _F),
        ("scale", _F),
        ("final_norm", _P),
        ("layer", ctypes.POINTER(_StackLayer)),
    ]


@dataclass(frozen=True)
class StackLayer:
    """A Llama decoder layer's weights as decoder_stack.c takes them: the norms' weights, each matmul's packed
    panels (LinearKernels.pack, or pack_blocks), float32 bias or None, and GGUF block kind or None; gated: whether
    gate_up's panels are in pack_gated's order, activated in the matmul (LinearKernels.linear's `gated`)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: tuple[torch.Tensor, torch.Tensor | None, str | None]
    o: tuple[torch.Tensor, torch.Tensor | None, str | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None, str | None]
    down: tuple[torch.Tensor, torch.Tensor | None, str | None]
    gated: bool = False


class DecoderStack:
    """A decode-only step through every layer of a Llama-family model in one native call: the same kernels as
    the modules call one by one (so bitwise the same hidden states), without the Python between them."""

    def __init__(
        self,
        library: Path,
        ops: FusedOps,
        attention: PagedAttention,
        linear: LinearKernels,
        layers: list[StackLayer],
        final_norm: torch.Tensor,
        *,
        q_heads: int,
        kv_heads: int,
        intermediate: int,
        eps: float,
        scale: float,
    ) -> None:
        dtype = self.dtype = final_norm.dtype
        if dtype != attention.dtype or dtype not in linear.dtypes:
            raise KernelUnavailable(f"{dtype} weights but {attention.dtype} attention kernels or no {dtype} matmuls")
        lib, name = _Library("decoder_stack", library), _DTYPES[dtype]
        self._run = lib(f"decoder_stack_{name}")
        self._workspace = lib("decoder_stack_workspace")
        self.hidden, self.q_heads, self.kv_heads, self.intermediate = (
            final_norm.numel(),
            q_heads,
            kv_heads,
            intermediate,
        )
        gated = {layer.gated for layer in layers}
        if len(gated) > 1:
            raise ValueError("either every layer's gate_up matmul is gated or none is")
        self._layers = (_StackLayer * len(layers))()
        self._weights = layers, final_norm  # the records point into these
        for record, layer in zip(self._layers, layers, strict=True):
            record.input_norm, record.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            for field_name in ("qkv", "o", "gate_up", "down"):
                panels, bias, blocks = getattr(layer, field_name)
                function = linear.function(panels, blocks, gated=layer.gated and field_name == "gate_up")
                setattr(record, field_name, panels.data_ptr())
                setattr(record, f"{field_name}_bias", None if bias is None else bias.data_ptr())
                setattr(record, f"{field_name}_linear", ctypes.cast(function, _P).value)
        # without silu_mul the stack takes the activation from the gated matmuls
        silu_mul = None if True in gated else ctypes.cast(ops._silu_mul[dtype], _P).value
        kernels = (ops._add_rms_norm[dtype], attention._rope_write_kv, attention._decode)
        add_rms_norm, rope_write_kv, decode = (ctypes.cast(fn, _P).value for fn in kernels)
        self._stack = _Stack(
            add_rms_norm,
            silu_mul,
            rope_write_kv,
            decode,
            len(layers),
            self.hidden,
            q_heads,
            kv_heads,
            attention.head_dim,
            intermediate,
            eps,
            scale,
            final_norm.data_ptr(),
            self._layers,
        )
        self.attention = attention
        self._caches: tuple[int, ...] = ()

    def _bind(self, caches: list[torch.Tensor]) -> None:
        """Point the layer records at these caches ([2, Hkv, num_blocks, block_size, D] each)."""
        if len(caches) != len(self._layers):
            raise ValueError(f"{len(caches)} caches for a stack of {len(self._layers)} layers")
        for record, cache in zip(self._layers, caches, strict=True):
            self.attention._check(self.q_heads, cache)
            if not cache.is_contiguous() or cache.dtype != self.dtype or cache.shape[1] != self.kv_heads:
                raise ValueError(
                    f"caches must be contiguous {self.dtype} with {self.kv_heads} KV heads, got {cache.dtype} "
                    f"{tuple(cache.shape)}"
                )
            record.cache, record.num_blocks = cache.data_ptr(), cache.shape[2]
        self._caches = tuple(c.data_ptr() for c in caches)

    def __call__(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        caches: list[torch.Tensor],
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B, hidden] embeddings of one decode token per request (used as the residual stream, so it is
        overwritten); cos_sin: rope.py's [B, 1, D] tables; slots, block_tables, context_lens: the decode group's
        (int64, contiguous). Returns the hidden states after the final norm, [B, hidden]."""
        if tuple(c.data_ptr() for c in caches) != self._caches:
            self._bind(caches)
        b = x.shape[0]
        if x.shape != (b, self.hidden) or x.dtype != self.dtype or not x.is_contiguous():
            raise ValueError(f"x must be contiguous {self.dtype} [B, {self.hidden}], got {x.dtype} {tuple(x.shape)}")
        if block_tables.shape[0] != b or block_tables.stride(1) != 1:
            raise ValueError(f"block tables must be [{b}, W] with contiguous rows, got {tuple(block_tables.shape)}")
        work = torch.empty(
            self._workspace(b, self.hidden, self.q_heads, self.kv_heads, self.attention.head_dim, self.intermediate),
            dtype=self.dtype,
        )
        out = torch.empty_like(x)
        cos, sin = cos_sin
        self._run(
            ctypes.byref(self._stack),
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            context_lens.data_ptr(),
            b,
            work.data_ptr(),
            out.data_ptr(),
        )
        return out


def load_paged_attention(
    dtype: torch.dtype, head_dim: int, block_size: int, group: int, *, portable: bool = False
) -> PagedAttention:
    """The kernels for these shapes (`group`: query heads per KV head), built on first use. `portable`:
    plain C only, without the CPU's bf16 dot-product instructions (tests use it to cover that path). Raises
    KernelUnavailable naming the reason."""
    if dtype not in _DTYPES:
        raise KernelUnavailable(f"no native paged-attention kernels for dtype {dtype} (only bfloat16 and float32)")
    defines = {"HEAD_DIM": head_dim, "BLOCK_SIZE": block_size, "GROUP": group} | ({"PORTABLE": 1} if portable else {})
    library = _build("paged_attention", defines)
    return PagedAttention(library, dtype, head_dim, block_size, group)


def load_fused_ops(*, portable: bool = False) -> FusedOps:
    """The fused element-wise ops, built on first use. `portable`: plain C only, without the AVX512-BF16 loops
    (tests use it to check them bit for bit). Raises KernelUnavailable naming the reason."""
    return FusedOps(_build("fused_ops", {"PORTABLE": 1} if portable else {}))


def load_linear_kernels() -> LinearKernels:
    """The matmul kernels (float32, and bfloat16 where the CPU has AVX512-BF16), built on first use. Raises
    KernelUnavailable naming the reason."""
    return LinearKernels(_build("linear", {}))


def load_decoder_stack() -> Path:
    """The decode-step loop over a Llama model's layers (decoder_stack.c), built on first use: the library
    DecoderStack loads. Raises KernelUnavailable naming the reason."""
    return _build("decoder_stack", {})


def load_kda_decode(head_dim: int) -> KDADecode:
    """The KDA decode step for this head_dim, built on first use. Raises KernelUnavailable naming the reason."""
    return KDADecode(_build("kda_decode", {"HEAD_DIM": head_dim}), head_dim)


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def library_files(name: str) -> list[Path]:
    """The files that go into library `name`: its sources (LIBRARIES), then the local headers they include, directly
    or through other headers (whichever #if branch includes them), sorted."""
    sources = [_HERE / source for source in LIBRARIES[name]]
    headers: set[Path] = set()
    pending = list(sources)
    while pending:
        for included in _INCLUDE.findall(pending.pop().read_text()):
            header = _HERE / included
            if header not in headers and header.is_file():
                headers.add(header)
                pending.append(header)
    return sources + sorted(headers)


def _build(name: str, defines: dict[str, int]) -> Path:
    """Library `name` (LIBRARIES) compiled with `defines` for this host, from the cache when it is there: one
    translation unit of its sources, in their order."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"C compiler {compiler!r} (from $CC, default cc) not found")
    sources = LIBRARIES[name]
    flags = _FLAGS + _isa_cap_flags() + tuple(f"-D{k}={v}" for k, v in defines.items())
    files = [path.name.encode() + b"\0" + path.read_bytes() for path in library_files(name)]
    key = hashlib.sha256(
        b"\0".join([*files, " ".join(flags).encode(), _compiler_version(compiler), _cpu_identity().encode()])
    ).hexdigest()[:16]
    root = cache_dir("kernels")
    library = root / "-".join([name, *(f"{k.lower()}{v}" for k, v in defines.items()), f"{key}.so"])
    if library.is_file():
        return library
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=f".{library.name}.", dir=root)
    os.close(fd)
    try:
        unit = "".join(f'#include "{source}"\n' for source in sources)  # read from stdin, sources from -I
        result = subprocess.run(
            [compiler, *flags, f"-I{_HERE}", "-x", "c", "-", "-o", tmp, "-lm"],
            input=unit,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise KernelUnavailable(
                f"{compiler} failed to build {name} ({', '.join(sources)}): {result.stderr.strip()[-2000:]}"
            )
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


def _cpu_flags() -> str:
    """/proc/cpuinfo's line of the first CPU's instruction-set flags ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cpu_identity() -> str:
    """The machine and its instruction-set flags: a -march=native library is only valid on the same CPU."""
    return f"{platform.machine()}\0{_cpu_flags()}"


def host_isa() -> str | None:
    """The highest of ISA_LEVELS this CPU has (each level needs the ones below it), None below AVX2 or off x86."""
    flags = set(_cpu_flags().partition(":")[2].split())
    level = None
    for name, (needs, _) in ISA_LEVELS.items():
        if not needs <= flags:
            break
        level = name
    return level


def max_isa() -> str | None:
    """The level the kernels are built for: the host's, or $HYBRIDSERVE_MAX_CPU_ISA's where that is lower. Raises
    ValueError for a value that names no level."""
    host, cap = host_isa(), os.environ.get(MAX_ISA_VARIABLE, "")
    if not cap:
        return host
    if cap not in ISA_LEVELS:
        raise ValueError(f"${MAX_ISA_VARIABLE} is {cap!r}; expected one of {', '.join(ISA_LEVELS)} (or unset)")
    levels = list(ISA_LEVELS)
    return cap if host is not None and levels.index(cap) < levels.index(host) else host


def _isa_cap_flags() -> tuple[str, ...]:
    """The compiler flags that hold a -march=native build to max_isa(): none where that is the host's level."""
    level = max_isa()
    return ISA_LEVELS[level][1] if level is not None and level != host_isa() else ()


def use_native_ops(model: torch.nn.Module, ops: FusedOps) -> None:
    """Hand `ops` to every module of `model` that can use them (those with a `native` attribute)."""
    for module in model.modules():
        if hasattr(module, "native"):
            module.native = ops
