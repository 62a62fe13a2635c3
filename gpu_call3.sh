#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_AUTOTUNING=1
t() { local name=$1 limit=$2; shift 2; local start=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt; }
t gpu_tests 170 python3 -m pytest -q -s tests/test_compat.py tests/gpu/test_prefetch.py tests/gpu/test_linear_cross_entropy.py tests/gpu/test_activation_offload.py tests/gpu/test_checkpoint_async.py
tail -3 $OUT/gpu_tests.log
t lce_bench 90 python3 bench/linear_cross_entropy.py
cp docs/performance.md $OUT/performance_lce.md
t padding 150 python3 -m pytest -q -s tests/gpu/test_hf_padding.py
grep -a "max |batch\|passed\|failed" $OUT/padding.log | tail -6
t offload_bench 170 python3 bench/train_throughput.py --models transformer --seq_lens 2048 --modes eager --activations none,full,offload,full+offload --quick
cp docs/performance.md $OUT/performance_offload.md
tail -12 $OUT/offload_bench.log
