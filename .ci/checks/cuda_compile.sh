#!/usr/bin/env bash
# The cuda device's third branch cannot rot: every shaders/*.metal compiled unchanged as CUDA
# (csrc/cuda/metal_cuda.h) by NVRTC to sm_90 cubins, every id of csrc/gpu/kernel_ids.h present
# once, each kernel's static threadgroup memory within Apple's 32 KiB (csrc/cuda/nvrtc_build.py),
# and the cuda device's C++ (csrc/cuda/cuda_device.cpp, driver loaded at run time) compiled.
# No GPU needed. NVRTC: $LILY_NVRTC, an installed nvidia-cuda-nvrtc, or the CUDA toolkit's; else
# nvidia-cuda-nvrtc 13.0.x (~90 MB, no newer than the H200's driver) is pip-installed into a
# throw-away target folder. No NVRTC at all is a failure, never a pass.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! "$PY" -c "import sys; sys.path.insert(0, 'csrc/cuda'); import nvrtc_build; nvrtc_build.find_nvrtc()" \
     >/dev/null 2>&1; then
  echo "cuda_compile: no NVRTC found; pip-installing nvidia-cuda-nvrtc==13.0.* into $tmp/nvrtc"
  "$PY" -m pip install -q --no-deps --target "$tmp/nvrtc" "nvidia-cuda-nvrtc==13.0.*"
  export PYTHONPATH="$tmp/nvrtc${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" csrc/cuda/nvrtc_build.py --out "$tmp/cubins" --arch sm_90 --check-ids -j "$(nproc)"
test -s "$tmp/cubins/manifest.txt"

CXX=${CXX:-c++}
for f in csrc/cuda/cuda_device.cpp csrc/core/device_registry.cpp; do
  "$CXX" -std=c++20 -fsyntax-only -Wall -Werror -DLILY_HAVE_CUDA=1 -Icsrc -Ishaders "$f"
done
echo "cuda_compile: OK"
