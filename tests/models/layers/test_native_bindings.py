"""The kernels' ctypes bindings come from their C prototypes: every EXPORT function of every source parses, every
library builds and exports what its sources declare for this build, and the parser maps C types as ctypes needs."""

import ctypes
import os
import re
import subprocess

import pytest

from hybridserve.models.layers import native
from hybridserve.models.layers.native import LIBRARIES, BindingError, Signature, parse_prototypes, signatures

# Compile-time shapes for the libraries that need them.
DEFINES = {"paged_attention": {"HEAD_DIM": 64, "BLOCK_SIZE": 16, "GROUP": 3}, "kda_decode": {"HEAD_DIM": 64}}


def test_parser_maps_c_types():
    text = """
    /* EXPORT void commented_out(int x); */
    #define DEFINE(NAME) EXPORT void NAME(int x) {}
    EXPORT int64_t scale(const float* restrict x, int64_t n,
                         float factor, double eps, int flag,
                         const uint16_t* const table[], void* out) {
        return 0;
    }
    EXPORT const char* name_of(void);
    EXPORT void nothing(void) {}
    EXPORT void unnamed(int64_t, const float*);
    """
    found = parse_prototypes(text, "example.c")
    assert set(found) == {"scale", "name_of", "nothing", "unnamed"}
    assert found["scale"] == Signature(
        "scale",
        ctypes.c_int64,
        (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int, ctypes.c_void_p)
        + (ctypes.c_void_p,),
        "example.c",
    )
    assert found["name_of"].restype is ctypes.c_char_p and found["name_of"].argtypes == ()
    assert found["nothing"].restype is None and found["nothing"].argtypes == ()
    assert found["unnamed"].argtypes == (ctypes.c_int64, ctypes.c_void_p)


def test_parser_rejects_what_it_cannot_read():
    with pytest.raises(BindingError, match=r"example.c: f: C type 'struct s' has no ctypes mapping"):
        parse_prototypes("EXPORT void f(struct s);", "example.c")
    with pytest.raises(BindingError, match=r"example.c: cannot read the EXPORT declaration"):
        parse_prototypes("EXPORT void g(void (*callback)(int));", "example.c")
    with pytest.raises(BindingError, match=r"example.c: h is declared EXPORT twice with different types"):
        parse_prototypes("#if A\nEXPORT int h(void) { return 0; }\n#else\nEXPORT long h(void);\n#endif", "example.c")


def test_every_source_parses():
    sources = {source for library in LIBRARIES.values() for source in library}
    on_disk = {path.name for path in native._HERE.glob("*.c")}
    assert sources == on_disk, "every kernel source is in one library of LIBRARIES"
    for source in sources:
        exported = signatures(source)
        text = (native._HERE / source).read_text()
        assert exported, f"{source} exports nothing"
        assert len(re.findall(r"^EXPORT\b", text, re.MULTILINE)) >= len(exported)
    for library in LIBRARIES:
        signatures(library)  # no name in two sources of a library


def _preprocessed_exports(library: str, defines: dict[str, int]) -> set[str]:
    """The EXPORT functions the preprocessed library (this host's flags) still declares: those its #if's keep."""
    flags = [f for f in native._FLAGS if f not in ("-shared",)] + list(native._isa_cap_flags())
    unit = "".join(f'#include "{source}"\n' for source in LIBRARIES[library])
    command = [os.environ.get("CC", "cc"), *flags, *(f"-D{k}={v}" for k, v in defines.items())]
    text = subprocess.run(
        [*command, f"-I{native._HERE}", "-E", "-P", "-x", "c", "-"],
        input=unit,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exported = r'__attribute__\(\(visibility\("default"\)\)\)\s+[\w\s*]*?\b(\w+)\s*\('  # EXPORT, expanded
    return set(re.findall(exported, text)) & set(signatures(library))


@pytest.mark.parametrize("library", LIBRARIES)
def test_library_exports_what_its_sources_declare(library):
    defines = DEFINES.get(library, {})
    try:
        path = native._build(library, defines)
    except native.KernelUnavailable as exc:
        pytest.skip(str(exc))
    lib = ctypes.CDLL(str(path))
    declared = signatures(library)
    built = _preprocessed_exports(library, defines)
    assert built
    for name in built:
        assert hasattr(lib, name), f"{name} ({declared[name].source}) is not exported by {path.name}"
    bound = native._Library(library, path)
    for name in built:
        assert bound(name).argtypes == list(declared[name].argtypes)


def test_a_function_no_source_exports_is_named():
    library = native._build("fused_ops", {})
    with pytest.raises(BindingError, match=r"no_such_kernel\(\) is not declared EXPORT in the fused_ops library's"):
        native._Library("fused_ops", library)("no_such_kernel")
