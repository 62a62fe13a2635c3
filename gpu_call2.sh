#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_AUTOTUNING=1
start=$(date +%s)
timeout 60 python3 -m pytest -q -s tests/test_compat.py > $OUT/compat.log 2>&1
echo "compat rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt; tail -4 $OUT/compat.log
mkdir -p /tmp/famcfg
for m in comba mom; do echo "{\"model_type\": \"$m\", \"hidden_size\": 256, \"num_hidden_layers\": 2, \"num_heads\": 4, \"vocab_size\": 4096}" > /tmp/famcfg/$m.json; done
for m in comba mom; do
  start=$(date +%s)
  MASTER_PORT=$((29000+RANDOM%900)) timeout 170 bash train.sh --model.config /tmp/famcfg/$m.json --training.steps 20 \
    --job.dump_folder /tmp/exp/$m --metrics.log_freq 5 --training.seq_len 2048 --training.local_batch_size 4 > $OUT/train_$m.log 2>&1
  echo "train $m rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt; grep -a "step 20/\|step  1/\|Error\|error:" $OUT/train_$m.log | tail -3
done
start=$(date +%s)
timeout 150 python3 -m pytest -q -s tests/gpu/test_fla_hopper_families.py > $OUT/comba_op.log 2>&1
echo "comba_op rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt; grep -a "comba T=\|passed\|failed" $OUT/comba_op.log | tail -4
start=$(date +%s)
timeout 170 python3 -m pytest -q -s tests/gpu/test_hf_padding.py > $OUT/padding.log 2>&1
echo "padding rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt; grep -a "max |batch\|passed\|failed" $OUT/padding.log | tail -6
