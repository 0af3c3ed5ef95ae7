#!/bin/bash
# The 40-layer real-shape measurement: benchmarks/gpu_kernels.py and lily-py bench on cuda
# (docs/gpu.md, "Measured speed"). Needs .whl/ as suites.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
mkdir -p ${OUT:-/tmp/lily_gpu_out}
python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.LILY_CUDA=ON > ${OUT:-/tmp/lily_gpu_out}/build.log 2>&1 || { tail -30 ${OUT:-/tmp/lily_gpu_out}/build.log; exit 1; }
python3 -c "
import time; t=time.time()
from lily_py.testing import make_checkpoint
from lily_py.tools.bench import _config_dict
make_checkpoint('/tmp/ck', _config_dict('real', 40), fmt='mlx', seed=0)
print('checkpoint 40 layers: %.1f s' % (time.time()-t))"
timeout 110 python3 benchmarks/gpu_kernels.py --model /tmp/ck --layers 40 --positions 256,32768 --prefill 0 --repeats 10 --trials 3 --json ${OUT:-/tmp/lily_gpu_out}/after.json 2>&1 | tee ${OUT:-/tmp/lily_gpu_out}/after.txt | head -60
timeout 80 lily-py bench --model /tmp/ck --backend cuda --contexts 256,4K --decode-tokens 8 2>&1 | tail -25
