#!/usr/bin/env bash
# Apple build check: clang's front end over csrc/metal/*.mm (Objective-C++, ARC) and every C++
# source in CMakeLists.txt for arm64-apple-macos14.0, against Apple's macOS 14.2 SDK headers
# (../shared/macos-sdk; the tool is ../shared/tools/check-apple-build and caches the unpacked
# headers under $HOME/.cache, so a read-only ../shared is fine). Parse + semantic analysis only:
# no shader compilation, no code generation, no linking (see docs/metal.md, "verified without a Mac").
set -euo pipefail
cd "$(dirname "$0")/../.."
TOOL=${LILY_APPLE_BUILD_TOOL:-../shared/tools/check-apple-build}
if [ ! -f "$TOOL" ]; then
  echo "apple_build: $TOOL not found (../shared must sit next to the project root)" >&2
  exit 1
fi
bash "$TOOL" .
