#!/bin/bash
# Batched decode on cuda (issue 42), one device call: build, the batched-decode tests on cuda
# (engine, device-sampled batches, API and the server's scheduler), the step timings (benchmarks/batch_decode.py --time,
# JSON to $OUT), the Batcher end to end (benchmarks/batch_live.py, JSON to $OUT), the host's part
# of a live step (tools/gpu/batch_host.py: decode_batch against the pipelined, device-sampled
# path), then compute-sanitizer memcheck and racecheck over a batched run (LIMIT seconds each).
# Needs .whl/ as suites.sh. KV=bfloat16|int8 (default bfloat16); SKIP_TESTS=1, SKIP_TIME=1,
# SKIP_LIVE=1, SKIP_HOST=1, SKIP_SAN=1 skip those parts.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lily_gpu_out}
mkdir -p $OUT
python3 -c "import lily_py._core as c, sys; sys.exit(0 if c.registry.check_usable('cuda')=='' else 1)" 2>/dev/null || {
  t0=$SECONDS
  python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.LILY_CUDA=ON > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
  echo "build: $((SECONDS - t0)) s"; }
if [ -z "${SKIP_TESTS:-}" ]; then
  t0=$SECONDS
  for f in tests/model/test_batch_decode.py tests/model/test_batch_sampling.py tests/api/test_generate_batch.py tests/serve/test_serve_batching.py; do
    ( LILY_TEST_ENGINE=cuda timeout 300 python3 -m pytest $f -q -p no:cacheprovider > /tmp/bt_$(basename $f .py).log 2>&1; echo "rc=$?" >> /tmp/bt_$(basename $f .py).log ) &
  done
  wait
  for f in /tmp/bt_*.log; do echo "$(basename $f .log): $(grep -E 'passed|failed|error' $f | tail -1) $(tail -1 $f)"; grep -E "^(FAILED|ERROR)" $f | head -5; done
  echo "tests: $((SECONDS - t0)) s"
fi
if [ -z "${SKIP_TIME:-}" ]; then
  t0=$SECONDS
  python3 benchmarks/batch_decode.py --time --kv-dtype ${KV:-bfloat16} --json $OUT/batch_${KV:-bfloat16}.json ${BENCH_ARGS:-}
  echo "timing: $((SECONDS - t0)) s"
fi
if [ -z "${SKIP_LIVE:-}" ]; then
  t0=$SECONDS
  python3 benchmarks/batch_live.py --json $OUT/batch_live_${KV:-bfloat16}.json ${LIVE_ARGS:-}
  echo "live: $((SECONDS - t0)) s"
fi
if [ -z "${SKIP_HOST:-}" ]; then
  t0=$SECONDS
  python3 tools/gpu/batch_host.py ${HOST_ARGS:-}
  echo "host split: $((SECONDS - t0)) s"
fi
if [ -z "${SKIP_SAN:-}" ]; then
  for tool in memcheck racecheck; do
    ( LILY_TEST_ENGINE=cuda timeout ${LIMIT:-150} compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest tests/model/test_batch_decode.py tests/model/test_batch_sampling.py -k "untouched or one_sequence or host_sampler" -q -p no:cacheprovider > /tmp/san_batch_$tool.log 2>&1; echo "rc=$?" >> /tmp/san_batch_$tool.log ) &
  done
  wait
  for tool in memcheck racecheck; do echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/san_batch_$tool.log | tail -1) | $(grep -E 'passed|failed' /tmp/san_batch_$tool.log | tail -1) | $(tail -1 /tmp/san_batch_$tool.log)"; done
fi
