#!/bin/bash
# Nsight Compute's full sections (stall reasons, source hot spots, memory, occupancy) for the
# decode kernels named in KERNELS (host names), one decode step at POSITION on LAYERS real-shape
# random layers (BATCH > 1: the batched step of BATCH sequences). LIB: a folder the package is
# already installed in (pip install --target), else it is built. Needs .whl/ as suites.sh.
# Output: $OUT/ncu_detail.txt.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${LIB:+$LIB:}/tmp/site || exit 1
O=${OUT:-/tmp/lily_gpu_out}; mkdir -p $O
python3 -c "import lily_py._core as c, sys; sys.exit(0 if c.registry.check_usable('cuda')=='' else 1)" 2>/dev/null || {
  python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.LILY_CUDA=ON > $O/build.log 2>&1 || { tail -30 $O/build.log; exit 1; }; }
cd /tmp
[ -d /tmp/ck${LAYERS:-4} ] || python3 -c "
from lily_py.testing import make_checkpoint
from lily_py.tools.bench import _config_dict
make_checkpoint('/tmp/ck${LAYERS:-4}', _config_dict('real', ${LAYERS:-4}), fmt='mlx', seed=0)"
M=$(python3 -c "import lily_py, os; print(os.path.join(os.path.dirname(lily_py.__file__), 'cuda_kernels', 'manifest.txt'))")
RE=$(for k in ${KERNELS:-moe_gate_up_mv_b4_xbf16_sbf16}; do awk -v k=$k '$3==k {print $2}' $M; done | paste -sd'|')
echo "kernels: ${KERNELS} -> $RE"
timeout ${NLIMIT:-240} ncu --clock-control none --profile-from-start off -k "regex:^($RE)\$" --launch-count ${COUNT:-6} \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section SchedulerStats \
  python3 $OLDPWD/tools/gpu/ncu_decode.py run /tmp/ck${LAYERS:-4} ${POSITION:-256} ${BATCH:-1} > $O/ncu_detail.txt 2>&1
echo "rc=$? lines=$(wc -l < $O/ncu_detail.txt)"
grep -E "lily_kernel|Duration|Stall|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Theoretical Occ|Memory Throughput|DRAM Throughput|Issued Warp|No Eligible" $O/ncu_detail.txt | head -${LINES:-120}
