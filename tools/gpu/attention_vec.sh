#!/bin/bash
# The vec decode attention alone (issue 41): benchmarks/gpu_kernels.py on LAYERS (4) real-shape
# random layers at POSITIONS (4096,32768,131072), for each KV dtype in KV (bfloat16 int8); the
# attention rows of each table. NCU=1 adds Nsight Compute's stall reasons and occupancy for the
# e8 vec kernels at NCU_POSITION (32767); SASS=1 their static instruction counts (and those of
# OLDTREE, a copy of shaders/ and csrc/ to compare with). Needs .whl/ as suites.sh. Output under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/lily_gpu_out}; mkdir -p $O
L=${LAYERS:-4}
T0=$(date +%s)
python3 -c "import lily_py._core as c, sys; sys.exit(0 if c.registry.check_usable('cuda')=='' else 1)" 2>/dev/null || {
  python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.LILY_CUDA=ON > $O/build.log 2>&1 || { tail -30 $O/build.log; exit 1; }; }
echo "build: $(( $(date +%s) - T0 )) s"
cd /tmp
[ -d /tmp/ck$L ] || python3 -c "
from lily_py.testing import make_checkpoint
from lily_py.tools.bench import _config_dict
make_checkpoint('/tmp/ck$L', _config_dict('real', $L), fmt='mlx', seed=0)"
for kv in ${KV:-bfloat16 int8}; do
  timeout ${KLIMIT:-200} python3 $OLDPWD/benchmarks/gpu_kernels.py --model /tmp/ck$L --layers $L \
    --positions ${POSITIONS:-4096,32768,131072} --prefill 0 --repeats 10 --trials 5 --kv-dtype $kv \
    --json $O/attention_vec_$kv.json > $O/attention_vec_$kv.txt 2>&1
  echo "== KV $kv (rc $?)"; grep -E "^gpu_kernels|^references|^decode at [0-9]+:|attn_decode_vec|attn_vec_combine" $O/attention_vec_$kv.txt
done
if [ "${NCU:-0}" = 1 ]; then
  M=$(python3 -c "import lily_py, os; print(os.path.join(os.path.dirname(lily_py.__file__), 'cuda_kernels', 'manifest.txt'))")
  RE=$(for k in attn_decode_vec_e8_bf16; do awk -v k=$k '$3==k {print $2}' $M; done | paste -sd'|')
  timeout ${NLIMIT:-150} ncu --clock-control none --profile-from-start off -k "regex:^($RE)\$" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    python3 $OLDPWD/tools/gpu/ncu_decode.py run /tmp/ck$L ${NCU_POSITION:-32767} > $O/ncu_attention_vec.txt 2>&1
  grep -E "Duration|Stall|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Theoretical Occ|DRAM Throughput|Issued Warp|No Eligible|Block Limit|Waves" $O/ncu_attention_vec.txt | head -60
fi
if [ "${SASS:-0}" = 1 ]; then  # static instruction counts of the e8 vec kernels (OLDTREE: a tree to compare)
  D=$(dirname $(python3 -c "import lily_py, os; print(os.path.join(os.path.dirname(lily_py.__file__), 'cuda_kernels', 'manifest.txt'))"))
  echo "== SASS, this tree"; python3 $OLDPWD/tools/gpu/sass_count.py $D attn_decode_vec_e8_bf16 attn_decode_vec_q8_e8_bf16
  if [ -n "$OLDTREE" ]; then
    python3 $OLDPWD/$OLDTREE/csrc/cuda/nvrtc_build.py --out /tmp/oldcubins --arch sm_90 > /dev/null 2>&1
    echo "== SASS, $OLDTREE"; python3 $OLDPWD/tools/gpu/sass_count.py /tmp/oldcubins attn_decode_vec_e8_bf16 attn_decode_vec_q8_e8_bf16
  fi
fi
