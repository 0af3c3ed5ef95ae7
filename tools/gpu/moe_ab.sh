#!/bin/bash
# A/B of a change to the batched decode step on cuda, one device call: builds the working tree
# and the commit in base.tar (git archive -o base.tar <commit>, untracked beside the tree), then
# per build: benchmarks/batch_decode.py --time --kernels on 8 layers (each kernel alone) and
# --time on the real 40 layers (JSON to $OUT); then the new build's MoE, matmul, DeltaNet and
# batch tests on cuda and compute-sanitizer on the MoE decode and the folded-norm kernel tests
# (SKIP_TESTS=1: not). SKIP_BASE=1 with ORDER=new:
# the working tree alone. VARIANTS=file (tools/gpu/ab.sh's `NAME | FILE | OLD | NEW` lines): more
# builds, each the working tree with those substitutions, timed after base and new. KB: the
# batches of the 8-layer per-kernel runs (default 4,8); SB: of the 40-layer steps (default
# 1,2,4,8; 0: none); VSB: SB of the variants (default SB). SKIP_BUILD=1: time the builds and
# checkpoints an earlier call left in /tmp (a warm machine), e.g. ORDER="s2 r2" SKIP_BUILD=1
# after a call that built them. Needs .whl/ as suites.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lily_gpu_out}
mkdir -p $OUT /tmp/base
names=""
[ -n "${VARIANTS:-}" ] && names=$(python3 tools/gpu/substitute.py "$VARIANTS" --names)
build() {  # build NAME DIR: the package from DIR into /tmp/lib_NAME, in the background
  ( cd $2 && PYTHONPATH=/tmp/site python3 -m pip install --no-build-isolation --no-deps --target /tmp/lib_$1 . \
      -Ccmake.define.LILY_CUDA=ON > $OUT/build_$1.log 2>&1; echo "$1 rc=$?" ) &
}
t0=$SECONDS
if [ -z "${SKIP_BUILD:-}" ]; then  # the trees: base.tar's, and the variants'
  [ -n "${SKIP_BASE:-}" ] || tar -xf base.tar -C /tmp/base || exit 1
  [ -z "$names" ] || python3 tools/gpu/substitute.py "$VARIANTS" /tmp || exit 1
  build new .
  [ -n "${SKIP_BASE:-}" ] || build base /tmp/base
  for n in $names; do build $n /tmp/v_$n; done
  for n in 8 40; do  # one random-weight checkpoint of the real shapes per depth, for every build
    ( PYTHONPATH=$PWD/src:/tmp/site python3 -c "from lily_py.testing import make_checkpoint; from lily_py.tools.bench import _config_dict; make_checkpoint('/tmp/ckpt$n', _config_dict('real', $n), fmt='mlx', seed=0)" > $OUT/checkpoint$n.log 2>&1; echo "checkpoint $n rc=$?" ) &
  done
  wait
  echo "builds and checkpoints: $((SECONDS - t0)) s"
fi
for v in ${ORDER:-base new $names}; do
  echo "=== $v"
  PYTHONPATH=/tmp/lib_$v:/tmp/site python3 benchmarks/batch_decode.py --time --model /tmp/ckpt8 --layers 8 --kernels --batches ${KB:-4,8} --prompt 8 --prefill-step 8 --trials 3 2>&1 | grep -v "^command"
  sb=${SB:-1,2,4,8}
  case " base new " in *" $v "*) ;; *) sb=${VSB:-$sb} ;; esac
  [ "$sb" = 0 ] || PYTHONPATH=/tmp/lib_$v:/tmp/site python3 benchmarks/batch_decode.py --time --model /tmp/ckpt40 --prompt 8 --prefill-step 8 --batches $sb --trials 5 --json $OUT/batch_$v.json 2>&1 | grep -v "^command"
  echo "t=$((SECONDS - t0))"
done
if [ -z "${SKIP_TESTS:-}" ]; then  # the new build's MoE and batch tests on cuda, and the sanitizers
  export PYTHONPATH=/tmp/lib_new:/tmp/site
  ( LILY_TEST_DEVICES=cuda timeout 150 python3 -m pytest tests/kernels/test_moe.py tests/kernels/test_quant_widths.py tests/kernels/test_quantized_matmul.py tests/kernels/test_gated_delta.py -q -p no:cacheprovider -k "cuda" > /tmp/ab_k.log 2>&1; echo "rc=$?" >> /tmp/ab_k.log ) &
  ( LILY_TEST_ENGINE=cuda timeout 150 python3 -m pytest tests/model/test_batch_decode.py -q -p no:cacheprovider > /tmp/ab_b.log 2>&1; echo "rc=$?" >> /tmp/ab_b.log ) &
  for tool in memcheck racecheck; do
    ( LILY_TEST_DEVICES=cuda timeout 150 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest tests/kernels/test_moe.py tests/kernels/test_gated_delta.py -q -p no:cacheprovider -k "cuda and (decode_matvec or exact_ties or nan_and_inf or folds_the_gated_norm)" > /tmp/ab_$tool.log 2>&1; echo "rc=$?" >> /tmp/ab_$tool.log ) &
  done
  wait
  for f in /tmp/ab_k.log /tmp/ab_b.log; do echo "$f: $(grep -E '[0-9]+ (passed|failed)' $f | tail -1) $(tail -1 $f)"; grep -E "^(FAILED|ERROR)" $f | head -5; done
  for tool in memcheck racecheck; do echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/ab_$tool.log | tail -1) | $(grep -E 'passed|failed' /tmp/ab_$tool.log | tail -1) | $(tail -1 /tmp/ab_$tool.log)"; done
  echo "tests: $((SECONDS - t0)) s"
  unset PYTHONPATH
fi
