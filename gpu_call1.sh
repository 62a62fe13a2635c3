#!/usr/bin/env bash
# Temporary device script (not committed): issue 21's first README command, 33's custom model, 25's padding check.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
# Issue 21: the seed README's first command, pasted verbatim; then local data/tokenizer in place of the hub ones, 20 steps.
CMD=$(sed -n 7p tests/config/upstream_readme.md)
CMD=${CMD/NGPU=8/NGPU=1 timeout 240}
start=$(date +%s)
( eval "MASTER_PORT=29611 $CMD --job.dump_folder /tmp/exp/vanilla --model.tokenizer_path flame/assets/tokenizer --training.dataset flame/assets/corpus --training.steps 20 --lr_scheduler.warmup_steps 10" ) > $OUT/readme_first.log 2>&1
echo "readme_first rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt
tail -5 $OUT/readme_first.log
# Issue 33: the custom model example on one GPU.
start=$(date +%s)
MASTER_PORT=29612 timeout 150 bash train.sh --experimental.custom_model_path examples/custom_models \
  --model.config examples/custom_models/decay_attn.json --training.steps 20 --job.dump_folder /tmp/exp/custom \
  --metrics.log_freq 5 > $OUT/custom.log 2>&1
echo "custom rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt
tail -4 $OUT/custom.log
ls /tmp/exp/custom /tmp/exp/custom/* 2>&1 | head -20 > $OUT/custom_ls.txt
# Issue 25: batch 16 vs batch 1 loglikelihoods on GPU.
start=$(date +%s)
timeout 170 python3 -m pytest -q -s tests/gpu/test_hf_padding.py > $OUT/padding.log 2>&1
echo "padding rc=$? wall=$(( $(date +%s)-start ))s" | tee -a $OUT/summary.txt
tail -8 $OUT/padding.log
