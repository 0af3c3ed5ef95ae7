#!/bin/bash
# After a kernel change: the 40-layer decode measurement (measure.sh without the prefill chunk),
# then, in parallel, the changed kernels' tests, the engine tests and the greedy check on the
# M5 (tensor-op) route, on cuda. Needs .whl/ as suites.sh.
PREFILL=0 CONTEXTS=256,32K KLINES=40 bash tools/gpu/measure.sh 2>&1 | tail -75
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
for f in kernels/test_quantized_matmul kernels/test_moe kernels/test_attention kernels/test_sampling_kernels; do b=$(basename $f)
  ( LILY_TEST_DEVICES=cuda timeout 200 python3 -m pytest tests/$f.py -k cuda -q -p no:cacheprovider > /tmp/k_$b.log 2>&1; echo "rc=$?" >> /tmp/k_$b.log ) &
done
for f in model/test_engine api/test_logprobs; do b=$(basename $f)
  ( LILY_TEST_ENGINE=cuda timeout 200 python3 -m pytest tests/$f.py -q -p no:cacheprovider > /tmp/k_$b.log 2>&1; echo "rc=$?" >> /tmp/k_$b.log ) &
done
( cd /tmp && LILY_CUDA_TENSOR_OPS=1 timeout 200 python3 $OLDPWD/csrc/cuda/greedy_check.py --chunks 1,64,4096 > /tmp/k_greedy_m5.log 2>&1; echo "rc=$?" >> /tmp/k_greedy_m5.log ) &
wait
for f in /tmp/k_*.log; do echo "$(basename $f .log): $(grep -E '[0-9]+ (passed|failed)' $f | tail -1) $(tail -1 $f)"; grep -E "^(FAILED|ERROR)" $f | head -5; done
tail -6 /tmp/k_greedy_m5.log
cp /tmp/k_*.log ${OUT:-/tmp}/ 2>/dev/null
