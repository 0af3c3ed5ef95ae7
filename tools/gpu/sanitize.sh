#!/bin/bash
# compute-sanitizer (TOOLS, default all four) over tests/kernels on cuda, one process per tool
# and file in parallel, LIMIT seconds each (docs/gpu.md, "Sanitizers"). Needs .whl/ as suites.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
# compute-sanitizer over tests/kernels on cuda: one process per test file and tool, in parallel
export PYTHONUNBUFFERED=1
mkdir -p ${OUT:-/tmp/lily_gpu_out}
python3 -c "import lily_py._core as c, sys; sys.exit(0 if c.registry.check_usable('cuda')=='' else 1)" 2>/dev/null || {
  python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.LILY_CUDA=ON > ${OUT:-/tmp/lily_gpu_out}/build.log 2>&1 || exit 1; }
mkdir -p ${OUT:-/tmp/lily_gpu_out}/san
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  for f in tests/kernels/test_*.py; do
    b=$(basename $f .py)
    ( LILY_TEST_DEVICES=cuda timeout ${LIMIT:-120} compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest $f -k cuda -q -p no:cacheprovider > /tmp/san_${tool}_$b.log 2>&1; echo "rc=$?" >> /tmp/san_${tool}_$b.log ) &
  done
  wait
  for f in /tmp/san_${tool}_*.log; do echo "$(basename $f .log): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep -E 'passed|failed' $f | tail -1) | $(tail -1 $f)"; done
  cat /tmp/san_${tool}_*.log > ${OUT:-/tmp/lily_gpu_out}/san/$tool.log
done
