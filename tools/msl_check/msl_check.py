#!/usr/bin/env python3
"""MSL semantic check: each shader's Metal branch as Apple's Metal compiler sees it.

For every shader file this (docs/msl-check.md):

1. compiles the Metal branch (``__METAL_VERSION__`` defined: 310 for shaders/*.metal, 400 with
   ``__HAVE_TENSOR__`` for Metal 4 files) with clang in C++ for OpenCL mode against the
   declarations-only stand-in headers in ``tools/msl_check/include`` (``<metal_stdlib>``,
   ``<metal_tensor>``, ``<MetalPerformancePrimitives/...>``): ``device``, ``threadgroup``,
   ``constant`` and ``thread`` are real, distinct address spaces, a program-scope or static variable
   outside ``constant`` fails, ``half`` and ``bfloat`` are types and cannot name anything, and every
   ``LILY_INSTANTIATE`` line explicitly instantiates its kernel, so each kernel body is checked with
   its template arguments. ``-Wall -Werror``; an implicit float / half -> bfloat conversion (an
   error in Metal, a warning in clang) fails too;
2. scans the translation unit's AST (libclang, ``pip install libclang``) for what the compile lets
   through: pointers and references without an explicit address space, member functions called on
   device / threadgroup / constant objects, program-scope / static variables outside ``constant``,
   MSL reserved words used as names;
3. scans the shader sources' tokens for reserved words in declarator position (names the AST never
   sees because the compile rejected them).

With ``--all`` it also compiles each Metal library's shaders as one translation unit, as the
run-time compile of csrc/metal/amalgamate.py's output sees them.

Usage::

    python tools/msl_check/msl_check.py --all                       # every shader TU, each library: ok / FAIL
    python tools/msl_check/msl_check.py [--clang CLANG] FILE...     # these files
    python tools/msl_check/msl_check.py --planted DIR               # bad_* must fail, good_* pass

A planted example's first lines may hold ``// expect: TEXT`` (a bad example must fail with TEXT in
its report) and ``// msl_check: version=NNN`` (the __METAL_VERSION__ to compile it at). Exit
status: 0 when every file passed (or every planted example behaved), 1 otherwise, 2 on a setup
error (no clang >= 17, no libclang).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = Path(__file__).resolve().parent / "include"
SHADERS = ROOT / "shaders"

# MSL names that cannot name a variable, parameter, field, function, type or macro: address-space
# and function qualifiers, built-in types (half, bfloat, sampler, the texture types) and
# attribute-like qualifiers of the spec (some are attributes rather than keywords in Apple's
# compiler; the check reserves them all). MSL 3.2 / 4.0 spec: "Address Spaces", "Function
# Qualifiers", "Scalar Data Types", "Textures", "Samplers", "Imageblocks", "Ray Tracing".
RESERVED = frozenset(
    """
    half bfloat kernel vertex fragment visible object mesh intersection stitchable
    device constant threadgroup thread threadgroup_imageblock ray_data object_data coherent
    patch stage_in sampler imageblock
    texture1d texture1d_array texture2d texture2d_array texture3d texturecube texturecube_array
    texture2d_ms texture2d_ms_array texture_buffer
    depth2d depth2d_array depthcube depthcube_array depth2d_ms depth2d_ms_array
    acceleration_structure primitive_acceleration_structure instance_acceleration_structure
    intersection_function_table visible_function_table indirect_command_buffer
    """.split()
)


def reserved_message(name: str) -> str:
    return f"'{name}' declared as a name: an MSL keyword / built-in type name (rename it)"


# libclang's LangAS values (clang_getAddressSpace): 0 none, 1 __global (device), 2 __local
# (threadgroup), 3 __constant (constant), 4 __private (thread), 5 __generic (not MSL).
AS_NAMES = {1: "device", 2: "threadgroup", 3: "constant", 4: "thread"}
AS_CONSTANT = 3
AS_GENERIC = 5


# Every translation unit of the project's Metal libraries, and the emulator's self-test kernels
# (emulator-only, never built by Apple's compiler: checked at MSL 3.2, the version whose
# atomic_thread_fence their ticket_sum kernel uses, and at 4.0 for the tensor-op ones).
def project_files() -> list[tuple[Path, int | None]]:
    files: list[tuple[Path, int | None]] = [(p, None) for p in sorted(SHADERS.glob("*.metal"))]
    files += [(p, None) for p in sorted((SHADERS / "m5").glob("*.metal"))]
    files += [(ROOT / "csrc/emu/selftest.metal", 320), (ROOT / "csrc/emu/selftest_m5.metal", 400)]
    return files


def metal_version(path: Path, text: str, override: int | None = None) -> int:
    m = re.search(r"^//\s*msl_check:\s*version=(\d+)", text[:2000], re.M)
    if m:
        return int(m.group(1))
    if override:
        return override
    # shaders/m5/*.metal: lily_m5.metallib, -std=metal4.0 with tensor support (CMakeLists.txt);
    # everything else: lily.metallib at MSL 3.1.
    if "m5" in path.parts or path.name.endswith("_m5.metal"):
        return 400
    return 310


def find_clang(explicit: str | None = None) -> str | None:
    candidates = [explicit] if explicit else []
    candidates += [os.environ.get("MSL_CHECK_CLANG", ""), "clang-19", "clang-18", "clang-17", "clang"]
    for c in candidates:
        if not c or not shutil.which(c):
            continue
        try:
            out = subprocess.run([c, "-dumpversion"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        if int(out.split(".")[0]) >= 17:
            return c
    return None


def clang_args(version: int) -> list[str]:
    """The flags of both the compile and the libclang parse (no -fsyntax-only / -Werror here)."""
    args = [
        "-x", "clcpp", "-cl-std=clc++2021",
        # No OpenCL headers or builtin function declarations, no system headers: only the stand-in.
        "-cl-no-stdinc", "-nostdinc", "-isystem", str(INCLUDE),
        # half arithmetic; the generic address space only so copies of structs across address
        # spaces compile (implicit copy members take a generic reference); pointers that rely on it
        # (none written without an address space) are what the AST scan rejects. No fp64 (MSL has
        # no double), no program-scope globals outside __constant.
        "-Xclang", "-cl-ext=-all,+cl_khr_fp16,+__opencl_c_generic_address_space",
        f"-I{SHADERS}", f"-I{ROOT / 'csrc'}",
        f"-D__METAL_VERSION__={version}",
    ]
    if version >= 310:
        args.append("-D__HAVE_BFLOAT__=1")
    if version >= 400:
        args.append("-D__HAVE_TENSOR__=1")
    return args


WARN_FLAGS = [
    "-Wall", "-Werror",
    # [[kernel]], [[buffer(n)]], [[thread_position_in_grid]], [[host_name(..)]], ... are Metal's.
    "-Wno-unknown-attributes",
    # Reported per conversion below: only a conversion to bfloat is an error in Metal.
    "-Wimplicit-float-conversion", "-Wno-error=implicit-float-conversion",
]


def translation_unit(src: Path) -> str:
    return (
        '#include "common/lily_metal.h"\n'
        '#include <lily_msl_check_kernels.h>\n'
        f'#include "{src.resolve()}"\n'
    )


@dataclass
class Finding:
    rule: str
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.message}"


@dataclass
class Result:
    path: Path
    version: int
    compile_ok: bool = True
    compile_output: str = ""
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    label: str | None = None  # a library's name (no single file)

    @property
    def name(self) -> str:
        return self.label or rel(self.path)

    @property
    def ok(self) -> bool:
        return self.compile_ok and not self.findings

    def report(self) -> str:
        parts = []
        if not self.compile_ok:
            parts.append(self.compile_output.rstrip())
        parts += [str(f) for f in self.findings]
        return "\n".join(parts)


def rel(p: str | Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


BF16_CONVERSION = re.compile(
    r"^(?P<file>[^:\n]+):(?P<line>\d+):\d+: warning: implicit conversion loses floating-point precision: "
    r"'(?P<src>[^']*)' to '(?P<dst>[^']*__bf16[^']*)'",
    re.M,
)


def compile_tu(clang: str, tu: Path, version: int) -> tuple[bool, str, list[Finding]]:
    cmd = [clang, *clang_args(version), "-fsyntax-only", *WARN_FLAGS, "-fno-caret-diagnostics",
           "-fdiagnostics-show-option", str(tu)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stderr + proc.stdout
    findings = [
        Finding("bfloat-implicit", rel(m["file"]), int(m["line"]),
                f"implicit conversion {m['src']} -> bfloat (MSL: float and half convert to bfloat only explicitly)")
        for m in BF16_CONVERSION.finditer(out)
    ]
    # Keep the errors (and their notes); the remaining implicit-float-conversion warnings are
    # legal MSL (float -> half).
    kept = [ln for ln in out.splitlines() if "[-Wimplicit-float-conversion]" not in ln]
    return proc.returncode == 0, "\n".join(kept), findings


# ---- the AST scan --------------------------------------------------------------------------------

def _cindex():
    import clang.cindex as ci  # pip install libclang

    return ci


def project_file(path: str | None, roots: list[Path]) -> bool:
    if not path:
        return False
    p = Path(path).resolve()
    return any(p == r or r in p.parents for r in roots)


def ast_scan(tu_path: Path, version: int, roots: list[Path]) -> list[Finding]:
    ci = _cindex()
    K = ci.CursorKind
    index = ci.Index.create()
    tu = index.parse(str(tu_path), args=[*clang_args(version), "-Wno-unknown-attributes"],
                     options=ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD)
    findings: list[Finding] = []
    seen: set[tuple] = set()

    def add(rule: str, cur, msg: str) -> None:
        loc = cur.location
        key = (rule, loc.file.name if loc.file else "", loc.line, msg)
        if key in seen:
            return
        seen.add(key)
        findings.append(Finding(rule, rel(loc.file.name) if loc.file else "?", loc.line, msg))

    def missing_as(t) -> str | None:
        """The first pointer / reference level of t (canonical) whose pointee has no MSL address space."""
        refs = (ci.TypeKind.POINTER, ci.TypeKind.LVALUEREFERENCE, ci.TypeKind.RVALUEREFERENCE)
        arrays = (ci.TypeKind.CONSTANTARRAY, ci.TypeKind.INCOMPLETEARRAY, ci.TypeKind.DEPENDENTSIZEDARRAY)
        while True:
            while t.get_canonical().kind in arrays:  # an array of pointers: its element type
                t = t.get_canonical().get_array_element_type()
            can = t.get_canonical()
            if can.kind not in refs:
                return None
            pointee = can.get_pointee()
            if pointee.get_address_space() not in AS_NAMES:
                # name the pointee as written where the type is not a typedef (T, not type-parameter-0-0)
                written = t.get_pointee() if t.kind in refs else pointee
                kind = "pointer" if can.kind == ci.TypeKind.POINTER else "reference"
                return (f"{kind} to '{written.spelling or pointee.spelling}' without an address space "
                        "(device, constant, threadgroup or thread)")
            t = t.get_pointee() if t.kind in refs else pointee

    def spelled_auto(cur) -> bool:
        # `auto& x = ...` / `auto* p = ...`: the address space comes with the deduced type, as in MSL.
        toks = [t.spelling for t in cur.get_tokens()]
        name = cur.spelling
        head = toks[: toks.index(name)] if name in toks else toks
        return "auto" in head or "decltype" in head

    decl_kinds = {K.PARM_DECL, K.VAR_DECL, K.FIELD_DECL}
    func_kinds = {K.FUNCTION_DECL, K.CXX_METHOD, K.FUNCTION_TEMPLATE, K.CONVERSION_FUNCTION}
    cast_kinds = {K.CSTYLE_CAST_EXPR, K.CXX_REINTERPRET_CAST_EXPR, K.CXX_STATIC_CAST_EXPR,
                  K.CXX_CONST_CAST_EXPR, K.CXX_FUNCTIONAL_CAST_EXPR}
    named_kinds = decl_kinds | func_kinds | {
        K.STRUCT_DECL, K.CLASS_DECL, K.UNION_DECL, K.ENUM_DECL, K.ENUM_CONSTANT_DECL, K.TYPEDEF_DECL,
        K.TYPE_ALIAS_DECL, K.TYPE_ALIAS_TEMPLATE_DECL, K.CLASS_TEMPLATE, K.NAMESPACE,
        K.TEMPLATE_TYPE_PARAMETER, K.TEMPLATE_NON_TYPE_PARAMETER, K.TEMPLATE_TEMPLATE_PARAMETER,
        K.MACRO_DEFINITION,
    }
    record_kinds = {K.STRUCT_DECL, K.CLASS_DECL, K.UNION_DECL, K.CLASS_TEMPLATE,
                    K.CLASS_TEMPLATE_PARTIAL_SPECIALIZATION}
    scope_kinds = {K.TRANSLATION_UNIT, K.NAMESPACE}

    def visit(cur, in_function: bool) -> None:
        for child in cur.get_children():
            loc = child.location
            mine = project_file(loc.file.name if loc.file else None, roots)
            kind = child.kind
            if mine:
                check(child, in_function)
            if not mine and kind in scope_kinds | record_kinds | func_kinds:
                continue  # a stand-in header's namespace, class or function: nothing of the project's
            visit(child, in_function or kind in func_kinds or kind in {K.LAMBDA_EXPR})

    def space_of(t) -> int:
        t = t.get_canonical()
        if t.kind == ci.TypeKind.POINTER:
            t = t.get_pointee()
        return t.get_address_space()

    def member_call_address_space(c) -> None:
        """`d[i].f()` / `d->f()` on a device, threadgroup or constant object: Metal's implicit object
        parameter is `thread` unless the member function names another address space; here it
        takes the object through a conversion to the generic address space, which Metal lacks."""
        method = c.referenced
        if method is None or method.kind not in (K.CXX_METHOD, K.CONVERSION_FUNCTION) or method.is_static_method():
            return
        kids = list(c.get_children())
        if not kids or kids[0].kind != K.UNEXPOSED_EXPR or space_of(kids[0].type) != AS_GENERIC:
            return
        inner = list(kids[0].get_children())
        if inner and space_of(inner[0].type) in (1, 2, 3):
            add("address-space", c,
                f"'{c.spelling}' called on a {AS_NAMES[space_of(inner[0].type)]} object: a member function takes "
                "a thread object unless it is declared for that address space (or copy the object first)")

    def check(c, in_function: bool) -> None:
        kind = c.kind
        if kind in named_kinds and c.spelling in RESERVED:
            add("reserved-name", c, reserved_message(c.spelling))
        if kind in decl_kinds and not spelled_auto(c):
            msg = missing_as(c.type)
            if msg:
                add("address-space", c, f"'{c.spelling}': {msg}")
        if kind in func_kinds:
            msg = missing_as(c.result_type)
            if msg:
                add("address-space", c, f"'{c.spelling}' returns a {msg}")
        if kind in (K.TYPEDEF_DECL, K.TYPE_ALIAS_DECL):
            msg = missing_as(c.underlying_typedef_type)
            if msg:
                add("address-space", c, f"'{c.spelling}' names a {msg}")
        if kind in cast_kinds:
            msg = missing_as(c.type)
            if msg:
                add("address-space", c, f"cast to a {msg}")
        if kind == K.MEMBER_REF_EXPR:
            member_call_address_space(c)
        if kind == K.VAR_DECL:
            parent = c.semantic_parent.kind if c.semantic_parent else None
            program_scope = parent in scope_kinds
            static_member = parent in record_kinds
            static_local = in_function and c.storage_class == ci.StorageClass.STATIC
            if (program_scope or static_member or static_local) and c.type.get_address_space() != AS_CONSTANT:
                what = ("program-scope variable" if program_scope else
                        "static data member" if static_member else "static local variable")
                add("constant-storage", c,
                    f"'{c.spelling}': a {what} must be in the constant address space (MSL: "
                    f"`constant constexpr T name = ...`, or an enumerator)")

    visit(tu.cursor, False)
    return findings


# ---- the token scan ------------------------------------------------------------------------------

TOKEN = re.compile(
    r"""(?P<comment>//[^\n]*|/\*.*?\*/)|(?P<string>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')"""
    r"""|(?P<directive>^[ \t]*\#[ \t]*[A-Za-z_]+)|(?P<ident>[A-Za-z_][A-Za-z_0-9]*)|(?P<num>\d[\w.']*)"""
    r"""|(?P<punct>::|->|&&|\|\||<<=|>>=|<<|>>|[=!<>+\-*/%&|^]=|[^\s\w])""",
    re.S | re.M,
)
NOT_A_TYPE_BEFORE = {"return", "case", "goto", "else", "do", "sizeof", "alignof", "decltype", "throw",
                     "new", "delete", "operator", "co_return", "co_yield", "and", "or", "not"}
# `threadgroup half,` / `const half)`: a type after a qualifier, not a name.
QUALIFIERS = {"const", "volatile", "device", "constant", "threadgroup", "thread", "threadgroup_imageblock",
              "ray_data", "object_data", "signed", "unsigned", "static", "constexpr", "inline"}
DECLARATOR_END = {"=", ";", ",", ")", "[", "{", ":", "("}


def token_scan(path: Path) -> list[Finding]:
    """Reserved words in declarator position (`T half = ...`, `U* half)`, `#define half`)."""
    text = path.read_text()
    toks: list[tuple[str, str, int]] = []  # (kind, text, line)
    for m in TOKEN.finditer(text):
        kind = m.lastgroup
        if kind in ("comment", "string"):
            continue
        toks.append((kind, m.group(kind).strip(), text.count("\n", 0, m.start()) + 1))
    findings: list[Finding] = []
    for i, (kind, tok, line) in enumerate(toks):
        if kind != "ident" or tok not in RESERVED:
            continue
        prev = toks[i - 1] if i else ("", "", 0)
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "", 0)
        is_macro = prev[0] == "directive" and re.sub(r"\s", "", prev[1]) in ("#define", "#undef")
        after_type = ((prev[0] == "ident" and prev[1] not in NOT_A_TYPE_BEFORE | QUALIFIERS)
                      or prev[1] in ("*", "&", "&&", ">"))
        # `(` after the name: a function named so (`float half(float)`), but `T* half(`... is rare;
        # a function-style cast `half(x)` never follows a type or an operator * & >.
        # `uint32_t row = t / 2, half = t % 2;`: a later declarator of a list
        later = prev[1] == "," and nxt[1] in ("=", ";", "[")
        if is_macro or (after_type and nxt[1] in DECLARATOR_END) or later:
            findings.append(Finding("reserved-name", rel(path), line, reserved_message(tok)))
    return findings


# ---- driver --------------------------------------------------------------------------------------

def included_project_files(src: Path, roots: list[Path]) -> list[Path]:
    """src and the project headers it includes (quoted includes, resolved like the compile)."""
    out: list[Path] = []
    todo = [src.resolve()]
    while todo:
        p = todo.pop()
        if p in out or not p.exists():
            continue
        out.append(p)
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), re.M):
            for base in (p.parent, SHADERS):
                q = (base / inc).resolve()
                if q.exists():
                    if project_file(str(q), roots):
                        todo.append(q)
                    break
    return out


def check_file(clang: str, src: Path, tmpdir: Path, scan: bool = True, version: int | None = None) -> Result:
    t0 = time.monotonic()
    text = src.read_text()
    version = metal_version(src, text, version)
    res = Result(src, version)
    tu = tmpdir / f"{zlib.crc32(str(src.resolve()).encode()):08x}_{src.name}.msl_check.clcpp"
    tu.write_text(translation_unit(src))
    roots = [SHADERS.resolve(), src.resolve()]
    res.compile_ok, res.compile_output, bf16 = compile_tu(clang, tu, version)
    res.findings += bf16
    if scan:
        res.findings += ast_scan(tu, version, roots)
        for f in included_project_files(src, roots):
            res.findings += token_scan(f)
        # one report per place and rule
        uniq = {}
        for f in res.findings:
            uniq.setdefault((f.rule, f.file, f.line, f.message), f)
        res.findings = list(uniq.values())
    res.seconds = time.monotonic() - t0
    return res


def check_library(clang: str, name: str, sources: list[Path], version: int, tmpdir: Path) -> Result:
    """One library's shaders as one translation unit, in build order: what the Metal device compiles
    at run time from csrc/metal/amalgamate.py's output (each header once), so a name defined by two
    shaders, or a host name instantiated twice, fails. Compile only (the per-file runs scan)."""
    t0 = time.monotonic()
    res = Result(Path(name), version, label=name)
    tu = tmpdir / (re.sub(r"\W+", "_", name.split(" ")[0]) + ".msl_check.clcpp")
    tu.write_text('#include "common/lily_metal.h"\n#include <lily_msl_check_kernels.h>\n'
                  + "".join(f'#include "{p.resolve()}"\n' for p in sources))
    res.compile_ok, res.compile_output, res.findings = compile_tu(clang, tu, version)
    res.seconds = time.monotonic() - t0
    return res


def libraries() -> list[tuple[str, list[Path], int]]:
    """The two Metal libraries (CMakeLists.txt: sorted globs, -std=metal3.1 / -std=metal4.0)."""
    return [("lily.metallib (shaders/*.metal as one TU)", sorted(SHADERS.glob("*.metal")), 310),
            ("lily_m5.metallib (shaders/m5/*.metal as one TU)", sorted((SHADERS / "m5").glob("*.metal")), 400)]


def expectation(src: Path) -> str | None:
    m = re.search(r"^//\s*expect:\s*(.+?)\s*$", src.read_text()[:2000], re.M)
    return m.group(1) if m else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--all", action="store_true",
                    help="every shader TU (shaders/*.metal, shaders/m5/*.metal) and the emulator's self-tests")
    ap.add_argument("--planted", type=Path, help="directory of bad_*.metal / good_*.metal examples")
    ap.add_argument("--metal-version", type=int,
                    help="__METAL_VERSION__ for the FILEs (default: 400 under m5/ or for *_m5.metal, else 310)")
    ap.add_argument("--clang", help="clang >= 17 (default: clang-19, -18, -17, clang)")
    ap.add_argument("--no-scan", action="store_true", help="compile only (no libclang AST / token scan)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="files checked at once (default 2)")
    a = ap.parse_args(argv)

    clang = find_clang(a.clang)
    if not clang:
        print("msl_check: needs clang >= 17 (clang-19: apt-get install clang-19)", file=sys.stderr)
        return 2
    if not a.no_scan:
        try:
            _cindex().Index.create()
        except Exception as e:  # noqa: BLE001 - ImportError or a missing libclang.so
            print(f"msl_check: needs libclang's Python bindings (pip install libclang): {e}", file=sys.stderr)
            return 2

    status = 0
    with tempfile.TemporaryDirectory(prefix="msl_check_") as td:
        tmp = Path(td)
        if a.planted:
            files = sorted(a.planted.glob("bad_*.metal")) + sorted(a.planted.glob("good_*.metal"))
            with ThreadPoolExecutor(max(1, a.jobs)) as pool:
                results = list(pool.map(lambda f: check_file(clang, f, tmp, not a.no_scan), files))
            for r in results:
                name = r.path.name
                if name.startswith("bad_"):
                    want = expectation(r.path)
                    report = r.report()
                    if r.ok:
                        print(f"  FAIL accepts {name} (a planted bad example)")
                        status = 1
                    elif want and want not in report:
                        print(f"  FAIL rejects {name} but not with '{want}':\n{report}")
                        status = 1
                    else:
                        print(f"  ok   rejects {name}" + (f" ({want})" if want else ""))
                else:
                    if r.ok:
                        print(f"  ok   accepts {name}")
                    else:
                        print(f"  FAIL rejects {name} (a planted good example):\n{r.report()}")
                        status = 1
            return status

        todo = project_files() if a.all else []
        todo += [(f, a.metal_version) for f in a.files]
        if not todo:
            ap.error("no files (give FILE..., --all or --planted DIR)")
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            results = list(pool.map(lambda fv: check_file(clang, fv[0], tmp, not a.no_scan, fv[1]), todo))
            if a.all:
                results += list(pool.map(lambda lib: check_library(clang, lib[0], lib[1], lib[2], tmp), libraries()))
        for r in results:
            if r.ok:
                print(f"  ok   {r.name} (Metal {r.version / 100:.1f}, {r.seconds:.1f} s)")
            else:
                print(f"  FAIL {r.name} (Metal {r.version / 100:.1f})")
                print("\n".join("       " + ln for ln in r.report().splitlines()))
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
