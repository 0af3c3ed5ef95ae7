#!/bin/bash
# The MoE expert kernels at every width pair on cuda (issue 41 item 4: the shared expert at its
# own width): the width tests, then compute-sanitizer memcheck and racecheck on the mixed pairs'
# cases (docs/mixed-bits.md). Needs .whl/ as suites.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/lily_gpu_out}; mkdir -p $O
python3 -c "import lily_py._core as c, sys; sys.exit(0 if c.registry.check_usable('cuda')=='' else 1)" 2>/dev/null || {
  python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.LILY_CUDA=ON > $O/build.log 2>&1 || { tail -30 $O/build.log; exit 1; }; }
F=tests/kernels/test_quant_widths.py
LILY_TEST_DEVICES=cuda python3 -m pytest -q -p no:cacheprovider $F -k "moe and cuda" 2>&1 | tail -3
for tool in memcheck racecheck; do
  LILY_TEST_DEVICES=cuda timeout ${LIMIT:-150} compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q \
    -p no:cacheprovider $F -k "shared_expert_at_its_own_width and cuda" > $O/san_$tool.log 2>&1
  echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $O/san_$tool.log | tail -1) | $(grep -E 'passed|failed' $O/san_$tool.log | tail -1)"
done
