#!/usr/bin/env bash
# Strict shader pass: every shaders/*.metal (and the emulator's self-test kernels) compiled by
# clang -fsyntax-only under csrc/emu/metal_strict.h, where `device`, `constant` and `threadgroup`
# are distinct address spaces: a device pointer passed where a thread or threadgroup pointer is
# expected fails here as it fails in Apple's Metal compiler. Needs clang >= 17 (arithmetic __bf16);
# installs Debian's clang-19 when no suitable clang is on PATH.
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
status=0
for src in shaders/*.metal csrc/emu/selftest.metal; do
  tu="$tmp/$(basename "$src").cpp"
  printf '#include "emu/metal_strict.h"\n#include "%s"\n' "$PWD/$src" > "$tu"
  if "$CLANG" -std=c++20 -fsyntax-only -Wall -Werror -Wno-unknown-attributes \
      -Icsrc -Ishaders "$tu"; then
    echo "  ok   $src"
  else
    echo "  FAIL $src"
    status=1
  fi
done
exit $status
