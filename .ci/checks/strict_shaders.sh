#!/usr/bin/env bash
# Strict shader pass: every shaders/*.metal (and the emulator's self-test kernels) compiled by
# clang -fsyntax-only under csrc/emu/metal_strict.h, where `device`, `constant` and `threadgroup`
# are distinct address spaces: a device pointer passed where a thread or threadgroup pointer is
# expected fails here as it fails in Apple's Metal compiler. C++14, the language MSL 3.x is based
# on; a threadgroup array outside a kernel's own scope fails too (csrc/emu/metal_strict.h); the
# pass first checks that it rejects both. Needs clang >= 17 (arithmetic __bf16); installs
# Debian's clang-19 when no suitable clang is on PATH.
# The M5 shaders (shaders/m5/*.metal, Metal 4 tensor ops) compile against
# csrc/emu/tensor_ops_strict.h as C++20: Metal 4 is C++17 based, and Apple's matmul2d takes its
# descriptor as a class-type template parameter, which clang accepts from C++20 only.
set -euo pipefail
cd "$(dirname "$0")/../.."

find_clang() {
  for c in clang++-19 clang++-18 clang++-17 clang++; do
    if command -v "$c" >/dev/null 2>&1; then
      major=$("$c" -dumpversion | cut -d. -f1)
      if [ "$major" -ge 17 ]; then echo "$c"; return 0; fi
    fi
  done
  return 1
}

CLANG=$(find_clang || true)
if [ -z "$CLANG" ]; then
  echo "strict_shaders: installing clang-19 (apt-get)"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq clang-19 >/dev/null
  CLANG=$(find_clang)
fi
echo "strict_shaders: $($CLANG --version | head -1)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
FLAGS=(-std=c++14 -fsyntax-only -Wall -Werror -Wno-unknown-attributes -Icsrc -Ishaders)

# The pass must reject what Apple's compiler rejects: these must fail to compile.
must_fail() {  # name, kernel source
  printf '#include "emu/metal_strict.h"\n#include "common/lily_metal.h"\nnamespace lily {\n%s\n}\n' "$2" > "$tmp/neg.cpp"
  if "$CLANG" "${FLAGS[@]}" "$tmp/neg.cpp" >/dev/null 2>&1; then
    echo "  FAIL strict pass accepts $1"
    exit 1
  fi
  echo "  ok   rejects $1"
}
must_fail "a threadgroup array in a helper function" '
inline float helper(uint lane) { LILY_TG_ARRAY(float, t, [32]); t[lane] = 1.0f; return t[0]; }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) { y[lane] = T(helper(lane)); }
LILY_INSTANTIATE("k", k<float>)'
must_fail "C++17 (if constexpr)" '
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) { if constexpr (sizeof(T) == 4) y[lane] = T(1.0f); }
LILY_INSTANTIATE("k", k<float>)'

must_fail "half as a name (a built-in type in MSL)" '
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) { const uint half = lane % 2; y[lane] = T(float(half)); }
LILY_INSTANTIATE("k", k<float>)'

must_fail "bfloat operands into a half accumulator (simdgroup_multiply_accumulate)" '
[[kernel]] void k(constant uint& n [[buffer(0)]], device half* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  simdgroup_bfloat8x8 a = make_filled_simdgroup_matrix<bfloat, 8, 8>(bfloat(1.0f));
  simdgroup_half8x8 c = make_filled_simdgroup_matrix<half, 8, 8>(half(0.0f));
  simdgroup_multiply_accumulate(c, a, a, c);
  simdgroup_store(c, y, 8);
}
LILY_INSTANTIATE("k", k)'

M5_FLAGS=(-std=c++20 "${FLAGS[@]:1}")
printf '#include "emu/metal_strict.h"\n#include "common/tensor_ops.h"\nnamespace lily {\n%s\n}\n' '
[[kernel]] void k(constant uint& n [[buffer(0)]], device half* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  auto t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(y, dextents<int32_t, 2>(8, 8));
  (void)t;
}
LILY_INSTANTIATE("k", k)' > "$tmp/neg_m5.cpp"
if "$CLANG" "${M5_FLAGS[@]}" "$tmp/neg_m5.cpp" >/dev/null 2>&1; then
  echo "  FAIL strict pass accepts a device pointer in a threadgroup tensor"
  exit 1
fi
echo "  ok   rejects a device pointer in a threadgroup tensor (M5 declarations)"

status=0
for src in shaders/*.metal csrc/emu/selftest.metal shaders/m5/*.metal csrc/emu/selftest_m5.metal; do
  tu="$tmp/$(basename "$src").cpp"
  printf '#include "emu/metal_strict.h"\n#include "%s"\n' "$PWD/$src" > "$tu"
  flags=("${FLAGS[@]}")
  case "$src" in shaders/m5/* | *_m5.metal) flags=("${M5_FLAGS[@]}") ;; esac
  if "$CLANG" "${flags[@]}" "$tu"; then
    echo "  ok   $src"
  else
    echo "  FAIL $src"
    status=1
  fi
done
exit $status
