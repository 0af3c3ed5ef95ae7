#!/bin/bash
# A/B of decode-kernel variants on one warm machine (docs/gpu-decode-ab.md). Each variant is the
# carried tree with text substitutions, built on its own (pip install --target /tmp/site_NAME);
# the baseline (the tree as carried) runs first and last, so the run-to-run noise shows. Needs
# .whl/ as suites.sh. The variants file has one substitution a line:
#     NAME | FILE | OLD TEXT | NEW TEXT
# (several lines of one NAME make one variant; `#` lines are comments). An OLD TEXT that is not
# in FILE stops the run before any build. Then, for every variant:
#     gpu_kernels.py --layers LAYERS --positions POSITIONS --prefill 0 --repeats 10 --trials 3
# on the random-weight checkpoint of measure.sh; the step and the kernels named by KERNELS
# (a grep -E pattern) are printed, the whole output kept as $OUT/ab_NAME.txt.
#     VARIANTS=tools/gpu/my_variants.txt bash tools/gpu/ab.sh
# DRY=1 only writes the variant trees (/tmp/v_NAME) and checks the substitutions: no GPU needed.
set -u
V=${VARIANTS:?VARIANTS=file of "NAME | FILE | OLD | NEW" lines}
O=${OUT:-/tmp/lily_gpu_out}; mkdir -p $O
R=$PWD; T0=$(date +%s); L=${LAYERS:-40}
names=$(python3 tools/gpu/substitute.py "$V" --names)
python3 tools/gpu/substitute.py "$V" /tmp base || exit 1
[ -n "${DRY:-}" ] && { echo "DRY: variant trees in /tmp/v_NAME for" base $names; exit 0; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
[ -f /tmp/ck$L/model.safetensors ] || ( PYTHONPATH=$R/src:/tmp/site python3 -c "
from lily_py.testing import make_checkpoint
from lily_py.tools.bench import _config_dict
make_checkpoint('/tmp/ck$L', _config_dict('real', $L), fmt='mlx', seed=0)" > $O/ab_checkpoint.log 2>&1 ) &
for n in base $names; do
  ( cd /tmp/v_$n && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_$n . \
      -Ccmake.define.LILY_CUDA=ON > $O/ab_build_$n.log 2>&1; echo "build $n rc=$? at $(( $(date +%s) - T0 )) s" ) &
done
wait
cd /tmp  # the built packages, not src/
for n in base $names base; do
  PYTHONPATH=/tmp/site_$n:/tmp/site timeout ${RUN_LIMIT:-90} python3 $R/benchmarks/gpu_kernels.py --model /tmp/ck$L \
    --layers $L --positions ${POSITIONS:-256} --prefill 0 --repeats 10 --trials 3 --kv-dtype ${KV:-bfloat16} > $O/ab_run.txt 2>&1
  echo "== $n rc=$?"; cat $O/ab_run.txt >> $O/ab_$n.txt
  grep -E "^decode at [0-9]+ |${KERNELS:-^(qmv1|moe_gate_up_mv|moe_down_mv)_}" $O/ab_run.txt | cut -c1-110
done
echo "total $(( $(date +%s) - T0 )) s"
