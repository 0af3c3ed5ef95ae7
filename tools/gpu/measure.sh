#!/bin/bash
# The 40-layer real-shape measurement: benchmarks/gpu_kernels.py and lily-py bench on cuda
# (docs/gpu.md, "Measured speed"). Needs .whl/ as suites.sh. LAYERS (40), POSITIONS and PREFILL
# choose the run; the checkpoint is built while the extension compiles.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/lily_gpu_out}; mkdir -p $O
L=${LAYERS:-40}
( PYTHONPATH=$PWD/src:$PYTHONPATH python3 -c "
import time; t=time.time()
from lily_py.testing import make_checkpoint
from lily_py.tools.bench import _config_dict
make_checkpoint('/tmp/ck', _config_dict('real', $L), fmt='mlx', seed=0)
print('random-weight checkpoint, real shapes, $L layers: %.1f s' % (time.time()-t))" > $O/checkpoint.log 2>&1 ) &
CK=$!
T0=$(date +%s)
python3 -c "import lily_py._core as c, sys; sys.exit(0 if c.registry.check_usable('cuda')=='' else 1)" 2>/dev/null || {
  python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.LILY_CUDA=ON > $O/build.log 2>&1 || { tail -30 $O/build.log; exit 1; }; }
echo "build: $(( $(date +%s) - T0 )) s"
wait $CK; cat $O/checkpoint.log
cd /tmp  # the installed package, not src/
timeout ${KLIMIT:-180} python3 $OLDPWD/benchmarks/gpu_kernels.py --model /tmp/ck --layers $L \
  --positions ${POSITIONS:-256,32768} --prefill ${PREFILL:-4096} --repeats 10 --trials 3 --cublas \
  --json $O/gpu_kernels.json 2>&1 | tee $O/gpu_kernels.txt | grep -v "^ *$" | head -${KLINES:-90}
timeout ${BLIMIT:-120} lily-py bench --model /tmp/ck --backend cuda --contexts ${CONTEXTS:-256,4K,32K} \
  --decode-tokens 16 --json $O/bench.json 2>&1 | tee $O/bench.txt | tail -25
# Nsight Compute's counters for one decode step (tools/gpu/ncu_decode.py)
[ "${NCU:-1}" != 0 ] && timeout ${NLIMIT:-120} ncu --clock-control none --profile-from-start off --csv \
  --log-file $O/ncu.csv --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__bytes_read.sum \
  python3 $OLDPWD/tools/gpu/ncu_decode.py run /tmp/ck ${NCU_POSITION:-256} > $O/ncu_run.log 2>&1; tail -3 $O/ncu_run.log
python3 $OLDPWD/tools/gpu/ncu_decode.py table $O/ncu.csv 2>&1 | head -40
