#!/bin/bash
# The engine and kernel suites on cuda, one pytest process per file (docs/gpu.md). Run on the
# H200 from the repository root with the wheels of scikit-build-core, pathspec, packaging and
# nanobind in .whl/ (../.library/device/README.md, Notes): bash tools/gpu/suites.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
mkdir -p ${OUT:-/tmp/lily_gpu_out}
python3 -c "import lily_py._core as c, sys; sys.exit(0 if c.registry.check_usable('cuda')=='' else 1)" 2>/dev/null || {
  T0=$(date +%s); python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.LILY_CUDA=ON > ${OUT:-/tmp/lily_gpu_out}/build.log 2>&1 || { tail -40 ${OUT:-/tmp/lily_gpu_out}/build.log; exit 1; }
  echo "build: $(( $(date +%s) - T0 )) s"; }
# one pytest process per file, in parallel (no xdist)
run() {  # run NAME ENV FILES...
  local name=$1 envs=$2; shift 2
  for f in "$@"; do b=$(basename $f .py)
    ( env $envs timeout ${RUN_LIMIT:-300} python3 -m pytest $f ${FULL:+--full} -q -p no:cacheprovider -p no:hypothesispytest -k "${K:-}" > /tmp/${name}_$b.log 2>&1; echo "rc=$?" >> /tmp/${name}_$b.log ) &
  done; wait
  for f in /tmp/${name}_*.log; do echo "$(basename $f .log): $(grep -E '[0-9]+ (passed|failed|skipped|error)' $f | tail -1) $(tail -1 $f)"; done
  cat /tmp/${name}_*.log > ${OUT:-/tmp/lily_gpu_out}/$name.log
}
# SUITES (default "model kernels"); MODEL_FILES: the engine tests (LILY_TEST_ENGINE), FULL=1 their
# full tier
MODEL_FILES=${MODEL_FILES:-tests/model/test_engine.py tests/api/test_logprobs.py}
for suite in ${SUITES:-model kernels}; do
  if [ $suite = model ]; then
    echo "--- model tests on cuda"
    K= run model "LILY_TEST_ENGINE=cuda" $MODEL_FILES
    grep -E "^(FAILED|ERROR)" ${OUT:-/tmp/lily_gpu_out}/model.log | head -20
  else
    echo "--- kernel tests on cuda"
    K=cuda run kernels "LILY_TEST_DEVICES=cuda" tests/kernels/test_*.py
    grep -E "^(FAILED|ERROR)" ${OUT:-/tmp/lily_gpu_out}/kernels.log | head -30
  fi
done
