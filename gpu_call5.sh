#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_AUTOTUNING=1
t() { local name=$1 limit=$2; shift 2; local start=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt; }
t muon 60 python3 bench/train_throughput.py --models transformer --seq_lens 2048 --modes eager --optimizers AdamW,Muon --quick --no_write
grep -a "| transformer" $OUT/muon.log | tail -2
t gdn_random 260 python3 bench/train_throughput.py --models gated_deltanet --seq_lens 2048 --modes compiled --quick --no_write
t gdn_real 80 python3 bench/train_throughput.py --models gated_deltanet --seq_lens 2048 --modes compiled --quick --data real --no_write
grep -a "| gated_deltanet" $OUT/gdn_random.log $OUT/gdn_real.log | tail -2
MASTER_PORT=29634 t gdn_trainsh 140 bash train.sh --model.config configs/gated_deltanet_340M.json --training.seq_len 2048 --training.local_batch_size 8 --training.steps 40 --compile.enable --metrics.log_freq 10 --job.dump_folder /tmp/exp/gdn --checkpoint.no-enable --lr_scheduler.warmup_steps 10
grep -a "step 20/\|step 30/\|step 40/" $OUT/gdn_trainsh.log | tail -3
