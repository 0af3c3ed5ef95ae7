#!/usr/bin/env bash
# MSL semantic pass: every shader's Metal branch (__METAL_VERSION__ 310 for shaders/*.metal, 400
# with __HAVE_TENSOR__ for shaders/m5/*.metal; the emulator's self-test kernels at 320 / 400) as
# Apple's Metal compiler sees it: clang in C++ for OpenCL mode against declarations-only stand-ins
# of <metal_stdlib>, <metal_tensor> and MetalPerformancePrimitives (tools/msl_check/include), with
# device / threadgroup / constant / thread as distinct address spaces, program-scope and static
# variables only in `constant`, half and bfloat as types, every LILY_INSTANTIATE line
# instantiating its kernel; then a libclang AST scan and a token scan for pointers and references
# without an address space, static storage outside `constant` and MSL reserved words used as
# names. docs/msl-check.md. First the planted examples of tests/tools/msl_check (each bad_* must
# fail with its stated reason, each good_* must pass), then every shader: ok / FAIL per file.
# Needs clang >= 17 (installs Debian's clang-19 when none is on PATH) and libclang's Python
# bindings (pip-installs `libclang` into the active environment: .ci/run's venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

find_clang() {
  for c in clang-19 clang-18 clang-17 clang; do
    if command -v "$c" >/dev/null 2>&1; then
      major=$("$c" -dumpversion | cut -d. -f1)
      if [ "$major" -ge 17 ]; then echo "$c"; return 0; fi
    fi
  done
  return 1
}

CLANG=$(find_clang || true)
if [ -z "$CLANG" ]; then
  echo "msl_semantics: installing clang-19 (apt-get)"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq clang-19 >/dev/null
  CLANG=$(find_clang)
fi
echo "msl_semantics: $($CLANG --version | head -1)"

if ! "$PY" -c 'import clang.cindex as c; c.Index.create()' >/dev/null 2>&1; then
  echo "msl_semantics: installing libclang's Python bindings (pip install libclang)"
  "$PY" -m pip install --quiet libclang
fi
"$PY" -c 'import clang.cindex as c; c.Index.create(); import importlib.metadata as m; print("msl_semantics: libclang", m.version("libclang"))'

status=0
echo "msl_semantics: planted examples (tests/tools/msl_check)"
"$PY" tools/msl_check/msl_check.py --clang "$CLANG" --planted tests/tools/msl_check || status=1

echo "msl_semantics: shaders"
"$PY" tools/msl_check/msl_check.py --clang "$CLANG" --all || status=1
exit $status
