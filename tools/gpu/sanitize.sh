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
# test_sampling_kernels.py's 148 cases do not finish in one 120 s process); SHARDS_FOR="file:N ..."
# sets N for one file (e.g. "test_sampling_kernels:6"). The TOOLS run one after another, or all at
# once with PARALLEL=1; FULL=1 takes each file's full tier.
SHARDS=${SHARDS:-1}
shards_of() { local n=$SHARDS; for e in ${SHARDS_FOR:-}; do [ "${e%%:*}" = "$1" ] && n=${e##*:}; done; echo $n; }
one_tool() {  # one_tool TOOL: every file (and shard) in parallel, then the summary lines
  local tool=$1 f b n s
  for f in ${FILES:-tests/kernels/test_*.py}; do
    b=$(basename $f .py); n=$(shards_of $b)
    if [ "$n" -gt 1 ]; then
      LILY_TEST_DEVICES=cuda python3 -m pytest $f ${FULL:+--full} -k cuda -q -p no:cacheprovider --collect-only 2>/dev/null | grep '::' > /tmp/ids_${tool}_$b.txt
      for s in $(seq 0 $((n - 1))); do
        awk -v n=$n -v s=$s 'NR % n == s' /tmp/ids_${tool}_$b.txt > /tmp/ids_${tool}_${b}_$s.txt
        [ -s /tmp/ids_${tool}_${b}_$s.txt ] || continue
        ( LILY_TEST_DEVICES=cuda timeout ${LIMIT:-120} compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest $(cat /tmp/ids_${tool}_${b}_$s.txt) ${FULL:+--full} -q -p no:cacheprovider > /tmp/san_${tool}_${b}_s$s.log 2>&1; echo "rc=$?" >> /tmp/san_${tool}_${b}_s$s.log ) &
      done
    else
      ( LILY_TEST_DEVICES=cuda timeout ${LIMIT:-120} compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest $f ${FULL:+--full} -k cuda -q -p no:cacheprovider > /tmp/san_${tool}_$b.log 2>&1; echo "rc=$?" >> /tmp/san_${tool}_$b.log ) &
    fi
  done
  wait
  for f in /tmp/san_${tool}_*.log; do echo "$(basename $f .log): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep -E 'passed|failed' $f | tail -1) | $(tail -1 $f)"; done
  cat /tmp/san_${tool}_*.log > ${OUT:-/tmp/lily_gpu_out}/san/$tool.log
}
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  if [ -n "${PARALLEL:-}" ]; then one_tool $tool > /tmp/san_summary_$tool.txt & else one_tool $tool; fi
done
wait
[ -n "${PARALLEL:-}" ] && cat /tmp/san_summary_*.txt
true
