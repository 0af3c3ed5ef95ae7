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
# FILES (default every tests/kernels/test_*.py) and SHARDS (default 1): with SHARDS=N each file's
# cuda cases are split round-robin into N processes (racecheck is ~100x slower than a plain run:
# test_sampling_kernels.py's 148 cases do not finish in one 120 s process).
SHARDS=${SHARDS:-1}
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  for f in ${FILES:-tests/kernels/test_*.py}; do
    b=$(basename $f .py)
    if [ "$SHARDS" -gt 1 ]; then
      LILY_TEST_DEVICES=cuda python3 -m pytest $f -k cuda -q -p no:cacheprovider --collect-only 2>/dev/null | grep '::' > /tmp/ids_$b.txt
      for s in $(seq 0 $((SHARDS - 1))); do
        awk -v n=$SHARDS -v s=$s 'NR % n == s' /tmp/ids_$b.txt > /tmp/ids_${b}_$s.txt
        [ -s /tmp/ids_${b}_$s.txt ] || continue
        ( LILY_TEST_DEVICES=cuda timeout ${LIMIT:-120} compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest $(cat /tmp/ids_${b}_$s.txt) -q -p no:cacheprovider > /tmp/san_${tool}_${b}_s$s.log 2>&1; echo "rc=$?" >> /tmp/san_${tool}_${b}_s$s.log ) &
      done
    else
      ( LILY_TEST_DEVICES=cuda timeout ${LIMIT:-120} compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest $f -k cuda -q -p no:cacheprovider > /tmp/san_${tool}_$b.log 2>&1; echo "rc=$?" >> /tmp/san_${tool}_$b.log ) &
    fi
  done
  wait
  for f in /tmp/san_${tool}_*.log; do echo "$(basename $f .log): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep -E 'passed|failed' $f | tail -1) | $(tail -1 $f)"; done
  cat /tmp/san_${tool}_*.log > ${OUT:-/tmp/lily_gpu_out}/san/$tool.log
done
