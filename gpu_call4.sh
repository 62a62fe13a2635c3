#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_AUTOTUNING=1
t() { local name=$1 limit=$2; shift 2; local start=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt; }
t padding 190 python3 -m pytest -q -s tests/gpu/test_hf_padding.py
grep -a "max |batch\|passed\|failed" $OUT/padding.log | tail -6
t prefetch 45 python3 -m pytest -q -s tests/gpu/test_prefetch.py
t lce_gpu 45 python3 -m pytest -q -s tests/gpu/test_linear_cross_entropy.py
tail -1 $OUT/prefetch.log $OUT/lce_gpu.log
t bench_random 75 python3 bench/train_throughput.py --models transformer --seq_lens 2048 --modes compiled --quick --no_write
t bench_real 75 python3 bench/train_throughput.py --models transformer --seq_lens 2048 --modes compiled --quick --data real --no_write
grep -a "| transformer" $OUT/bench_random.log $OUT/bench_real.log | tail -2
MASTER_PORT=29633 t trainsh 120 bash train.sh --model.config configs/transformer_340M.json --training.seq_len 2048 --training.local_batch_size 8 --training.steps 40 --compile.enable --metrics.log_freq 10 --job.dump_folder /tmp/exp/tp --checkpoint.no-enable --lr_scheduler.warmup_steps 10
grep -a "step 40/\|step 30/\|step 20/" $OUT/trainsh.log | tail -3
