"""The MSL semantic check (tools/msl_check/msl_check.py, docs/msl-check.md): every planted bad
example of tests/tools/msl_check is rejected for its stated reason, every good one is accepted, and
every shader translation unit passes.

CI runs the whole check, clang and libclang installed, via `.ci/checks/msl_semantics.sh`; here the
tests skip when clang >= 17 or libclang's Python bindings (`pip install libclang`) are missing.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLANTED = Path(__file__).resolve().parent / "msl_check"


def _load_check():
    spec = importlib.util.spec_from_file_location("msl_check", ROOT / "tools" / "msl_check" / "msl_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("msl_check", mod)
    spec.loader.exec_module(mod)
    return mod


M = _load_check()

# Each rule of the check with its planted examples: (bad ones, good ones).
RULES = {
    "program-scope variable outside constant": (["bad_program_scope_variable"], ["good_program_scope_constant"]),
    "static data member outside constant": (["bad_static_data_member"], ["good_static_member_enumerator"]),
    "static local outside constant": (["bad_static_local"], ["good_constant_table"]),
    "half / bfloat / MSL reserved word as a name": (
        ["bad_half_local_name", "bad_half_parameter_name", "bad_bfloat_name", "bad_reserved_name",
         "bad_reserved_macro"],
        ["good_reserved_words_as_types"]),
    "pointer / reference without an address space": (
        ["bad_pointer_parameter_no_address_space", "bad_reference_no_address_space",
         "bad_local_pointer_no_address_space", "bad_cast_no_address_space",
         "bad_template_pointer_no_address_space"],
        ["good_address_spaces"]),
    "distinct address spaces; constant is read-only": (
        ["bad_device_pointer_as_thread", "bad_threadgroup_tensor_device_pointer_m5", "bad_write_to_constant"],
        ["good_address_spaces", "good_matmul2d_m5"]),
    "member function on a device / threadgroup / constant object": (["bad_member_call_on_device_object"],
                                                                   ["good_member_call_on_thread_object"]),
    "kernel bodies instantiated": (["bad_instantiated_kernel_body"], ["good_simdgroup_matrix"]),
    "MSL version gates (atomic_thread_fence is 3.2)": (["bad_fence_msl31"], ["good_fence_msl32"]),
    "float / half -> bfloat only explicitly": (["bad_bfloat_implicit_conversion"], ["good_bfloat_explicit_conversion"]),
    "no double": (["bad_double"], ["good_simd_functions"]),
    "only the spec's declarations": (
        ["bad_simd_sum_bfloat", "bad_unknown_function", "bad_as_type_size", "bad_simdgroup_matrix_half_accumulator",
         "bad_matmul2d_types_m5"],
        ["good_simd_functions", "good_simdgroup_matrix", "good_matmul2d_m5"]),
}


@pytest.fixture(scope="module")
def clang():
    c = M.find_clang()
    if not c:
        pytest.skip("needs clang >= 17 (apt-get install clang-19); CI: .ci/checks/msl_semantics.sh")
    try:
        M._cindex().Index.create()
    except Exception as e:  # noqa: BLE001 - ImportError, or the bindings cannot load libclang.so
        pytest.skip(f"needs libclang's Python bindings (pip install libclang): {e}")
    return c


def test_every_rule_has_planted_examples():
    names = {p.stem for p in PLANTED.glob("*.metal")}
    listed = set()
    for rule, (bad, good) in RULES.items():
        assert bad and good, rule
        for n in bad + good:
            assert n in names, f"{rule}: tests/tools/msl_check/{n}.metal is missing"
            listed.add(n)
    assert names == listed, f"planted examples no rule lists: {sorted(names - listed)}"
    for p in PLANTED.glob("bad_*.metal"):
        assert M.expectation(p), f"{p.name}: a bad example states its reason (// expect: ...)"


@pytest.mark.parametrize("name", sorted(p.name for p in PLANTED.glob("bad_*.metal")))
def test_planted_bad_example_is_rejected_for_its_reason(clang, name, tmp_path):
    src = PLANTED / name
    r = M.check_file(clang, src, tmp_path)
    assert not r.ok, f"{name} passed the check"
    want = M.expectation(src)
    assert want in r.report(), f"{name}: rejected, but not with {want!r}:\n{r.report()}"


@pytest.mark.parametrize("name", sorted(p.name for p in PLANTED.glob("good_*.metal")))
def test_planted_good_example_is_accepted(clang, name, tmp_path):
    r = M.check_file(clang, PLANTED / name, tmp_path)
    assert r.ok, f"{name}:\n{r.report()}"


@pytest.mark.parametrize("path,version", [(str(p.relative_to(ROOT)), v) for p, v in M.project_files()])
def test_shader_passes(clang, path, version, tmp_path):
    r = M.check_file(clang, ROOT / path, tmp_path, version=version)
    assert r.ok, f"{path} (Metal {r.version}):\n{r.report()}"


def test_library_tu_rejects_a_name_defined_by_two_shaders(clang, tmp_path):
    """--all also compiles each library's shaders as one TU (the run-time compile of the
    amalgamated source): a helper defined in two shaders fails there, not in either file alone."""
    body = """#include "common/lily_metal.h"
namespace lily {
inline float helper(float x) { return 2.0f * x; }
template <typename T>
[[kernel]] void KNAME(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[lane] = T(helper(1.0f));
}
LILY_INSTANTIATE("KNAME", KNAME<float>)
}  // namespace lily
"""
    a, b = tmp_path / "a.metal", tmp_path / "b.metal"
    a.write_text(body.replace("KNAME", "ka"))
    b.write_text(body.replace("KNAME", "kb"))
    assert M.check_file(clang, a, tmp_path).ok and M.check_file(clang, b, tmp_path).ok
    r = M.check_library(clang, "two", [a, b], 310, tmp_path)
    assert not r.ok and "redefinition of 'helper'" in r.report(), r.report()


@pytest.mark.parametrize("name,sources,version", M.libraries(), ids=["lily", "lily_m5"])
def test_library_as_one_tu_passes(clang, name, sources, version, tmp_path):
    r = M.check_library(clang, name, sources, version, tmp_path)
    assert r.ok, f"{name}:\n{r.report()}"
