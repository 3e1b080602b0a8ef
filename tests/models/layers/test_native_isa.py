"""Which instruction sets the native kernels are built for: the host's level from /proc/cpuinfo's flags, and
$HYBRIDSERVE_MAX_CPU_ISA holding the build to a lower level, so one host runs the kernel variants of the hosts
below it (`make test-isa-cap`, which .ci/run runs on a host with more than AVX2)."""

from __future__ import annotations

import pytest
import torch

from hybridserve.models.layers import native
from hybridserve.models.layers.native import ISA_LEVELS, MAX_ISA_VARIABLE, host_isa, load_linear_kernels, max_isa

# /proc/cpuinfo flags of the hosts this project runs on, trimmed to what tells the levels apart
ZEN3 = "flags\t\t: fpu sse2 avx f16c fma avx2 bmi2"
ZEN4 = f"{ZEN3} avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 avx512vbmi"
SAPPHIRE_RAPIDS = f"{ZEN4} amx_bf16 amx_tile amx_int8"
SKYLAKE_X = f"{ZEN3} avx512f avx512dq avx512cd avx512bw avx512vl"


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (ZEN3, "avx2"),
        (ZEN4, "avx512_bf16"),
        (SAPPHIRE_RAPIDS, "amx"),
        (SKYLAKE_X, "avx512"),
        ("flags\t\t: fpu sse2 avx fma f16c", None),  # no AVX2
        (f"{ZEN3} amx_tile amx_bf16", "avx2"),  # a level needs every level below it
        ("Features\t: fp asimd", None),  # aarch64
        ("", None),  # no /proc/cpuinfo
    ],
)
def test_the_host_level_is_the_highest_whose_flags_it_has_all_of(
    monkeypatch: pytest.MonkeyPatch, flags: str, level: str | None
) -> None:
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    monkeypatch.delenv(MAX_ISA_VARIABLE, raising=False)
    assert host_isa() == level
    assert max_isa() == level
    assert native._isa_cap_flags() == ()


@pytest.mark.parametrize(
    ("flags", "cap", "level", "compiler_flags"),
    [
        (ZEN4, "avx2", "avx2", ("-mno-avx512f", "-mno-amx-tile")),
        (ZEN4, "avx512", "avx512", ("-mno-avx512bf16", "-mno-avx512vnni", "-mno-amx-tile")),
        (SAPPHIRE_RAPIDS, "avx512_bf16", "avx512_bf16", ("-mno-amx-tile",)),
        (ZEN4, "avx512_bf16", "avx512_bf16", ()),  # the host's own level: the native build
        (ZEN3, "amx", "avx2", ()),  # a cap above the host changes nothing
        (ZEN4, "", "avx512_bf16", ()),  # set but empty: no cap
    ],
)
def test_a_cap_lowers_the_build_and_never_raises_it(
    monkeypatch: pytest.MonkeyPatch, flags: str, cap: str, level: str, compiler_flags: tuple[str, ...]
) -> None:
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    monkeypatch.setenv(MAX_ISA_VARIABLE, cap)
    assert max_isa() == level
    assert native._isa_cap_flags() == compiler_flags


def test_a_cap_that_names_no_level_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_ISA_VARIABLE, "AVX2")
    with pytest.raises(
        ValueError, match=r"^\$HYBRIDSERVE_MAX_CPU_ISA is 'AVX2'; expected one of avx2, avx512, avx512_bf16, amx"
    ):
        load_linear_kernels()


def test_the_library_runs_the_level_it_was_built_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled library's own BUILT_ISA (cpu_math.h), uncapped and at each level below the host's; a level's
    kernels have its geometry (float32 panels of two vectors: 16 columns with AVX2, 32 with AVX-512) and bf16
    matmuls only from AVX512-BF16 up."""
    host = host_isa()
    if host is None:
        pytest.skip("the kernels' levels start at AVX2; this CPU has none of them")
    monkeypatch.delenv(MAX_ISA_VARIABLE, raising=False)
    assert load_linear_kernels().isa == host
    levels = list(ISA_LEVELS)
    for level in levels[: levels.index(host) + 1]:
        monkeypatch.setenv(MAX_ISA_VARIABLE, level)
        kernels = load_linear_kernels()
        assert kernels.isa == level
        assert kernels.panel_width[torch.float32] == (16 if level == "avx2" else 32)
        assert (torch.bfloat16 in kernels.dtypes) == (levels.index(level) >= levels.index("avx512_bf16"))
