#!/usr/bin/env bash
# Launch a flame training job: NGPU=8 bash train.sh --job.config_file job.toml --model.config configs/x.json ...
#
# Environment: NGPU (processes per node; default: visible GPUs, 1 without GPU — CPU processes then),
# NNODE (nodes, default 1), NODE_RANK (default 0), MASTER_ADDR (default localhost), MASTER_PORT (one node: a free port;
# several nodes: 29500), LOG_RANK (ranks whose output the console shows, comma separated, default 0),
# FLAME_TORCHRUN=1 (start one node's ranks through torchrun too). Every rank's full output is kept under
# <dump_folder>/logs, the launcher's own messages in <dump_folder>/logs/launcher.log.
set -uo pipefail

visible_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then n=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .); fi
    echo "${n:-0}"
  else
    echo 0
  fi
}

gpus=$(visible_gpus)
# The pre-flight takes this count rather than import torch to count (flame.launch.visible_gpus).
if command -v nvidia-smi >/dev/null 2>&1; then export FLAME_VISIBLE_GPUS=$gpus; fi
NGPU=${NGPU:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 1)}
NNODE=${NNODE:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
LOG_RANK=${LOG_RANK:-0}
export NGPU

# Check the job before starting ranks: a mistake is one line here, not a traceback per rank.
# --help and --job.dry_run are answered by this step alone.
env_file=$(mktemp)
# The pre-flight takes <dump_folder>/flame.lock for this script's pid (flame.checkpoint.lock); it is removed on exit.
release_lock() {
  rm -f "$env_file"
  local lock=${FLAME_DUMP_LOCK:-}
  if [ -n "$lock" ] && grep -q "\"host\": \"$(hostname)\", \"pid\": $$," "$lock" 2>/dev/null; then rm -f "$lock"; fi
}
trap release_lock EXIT
FLAME_LAUNCH_ENV=$env_file python -m flame.launch "$@"
rc=$?
if [ "$rc" -eq 10 ]; then exit 0; fi
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
# shellcheck disable=SC1090
source "$env_file"  # DUMP_FOLDER; on one node without MASTER_PORT, a free port
MASTER_PORT=${MASTER_PORT:-29500}

mkdir -p "$DUMP_FOLDER/logs"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}
# Triton keeps autotuning results in its cache (~/.triton/cache, or TRITON_CACHE_DIR): FLA's kernels tune for 1-3
# minutes per process, and with several ranks each tunes beside the others' collectives. With the results cached,
# a restart loads them, and a 2-step NGPU=1 run before a multi-GPU job gives every rank the configs tuned on a
# quiet GPU (docs/performance.md, "Several H200s with FSDP"). TRITON_CACHE_AUTOTUNING=0 turns it off.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
# End of run: rank 0 converts the final checkpoint (the latest complete one past step 0) to an HF folder in the
# dump folder, as upstream flame's train.sh does, once the run has finished (not after a failure or a preemption),
# with the model config and tokenizer the checkpoint records (flame.hf.export.export_after_training, in the rank:
# its imports are done). FLAME_EXPORT_HF=0 skips it; only node 0 exports.
if [ "${FLAME_EXPORT_HF:-1}" != 0 ] && [ "$NODE_RANK" -eq 0 ]; then export FLAME_EXPORT_HF_AT_END=1; fi
# The launcher's own messages (torchrun's warnings, and after a failed rank its ChildFailedError traceback and
# summary; flame.launch_local's report) go to <dump_folder>/logs/launcher.log: the ranks' lines ([rankN]: ...)
# pass, so a rank's refusal stays the last line.
launcher_log="$DUMP_FOLDER/logs/launcher.log"
# Launches into the same dump folder append to it: this launch's report starts after its present bytes.
launcher_log_start=1
if [ -f "$launcher_log" ]; then launcher_log_start=$(($(wc -c < "$launcher_log") + 1)); fi
last_line=$(mktemp)
# A GPU compiles each Triton kernel at its first call, one after another inside the first step: a process of its
# own runs one block of each kind of the model meanwhile and leaves the kernels in Triton's cache for the ranks
# (flame/train/prewarm.py; its log is <dump_folder>/logs/prewarm.log, prewarm-node<N>.log for node N of several).
# FLAME_PREWARM=0 turns it off.
prewarm_pid=""
if [ "$gpus" -gt 0 ] && [ "${FLAME_PREWARM:-1}" != 0 ]; then
  prewarm_log="$DUMP_FOLDER/logs/prewarm.log"
  if [ "$NNODE" -gt 1 ]; then prewarm_log="$DUMP_FOLDER/logs/prewarm-node$NODE_RANK.log"; fi
  NNODE=$NNODE python -m flame.train.prewarm "$@" > "$prewarm_log" 2>&1 &
  prewarm_pid=$!
fi
stop_prewarm() { if [ -n "$prewarm_pid" ]; then kill "$prewarm_pid" 2>/dev/null; fi; }
trap 'release_lock; rm -f "$last_line"; stop_prewarm' EXIT

# Preemption (docs/checkpoints.md): SIGTERM or SIGUSR1 sent to this script goes to the ranks of this node, which
# finish their step, save a checkpoint and exit; this script then exits with 75 (76: stopped without that save),
# the status to requeue on. The launcher (torchrun, or flame.launch_local) runs with SIGUSR1 ignored (its default
# action would kill it and orphan the ranks); the ranks install their own handler.
preempted_marker="$DUMP_FOLDER/preempted.json"
rm -f "$preempted_marker"
signalled=""
launcher_pid=""
forward_signal() {
  signalled=$1
  [ -n "$launcher_pid" ] || return 0
  local rank_pid
  for rank_pid in $(pgrep -P "$launcher_pid"); do kill -s "$1" "$rank_pid" 2>/dev/null; done
}
trap 'forward_signal TERM' TERM
trap 'forward_signal USR1' USR1
# The ranks of one node rendezvous through rank 0 (MASTER_ADDR:MASTER_PORT): flame.launch_local starts them as
# torchrun would (environment, log files, [rankN]: lines, signals, the first failure stopping the others, exit
# status), without torchrun's imports of torch. Several nodes, or FLAME_TORCHRUN=1, use torchrun.
if [ "$NNODE" -eq 1 ] && [ "${FLAME_TORCHRUN:-0}" != 1 ]; then
  launcher=(python -m flame.launch_local --nproc-per-node "$NGPU" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
else
  launcher=(torchrun --nnodes "$NNODE" --nproc_per_node "$NGPU" --node_rank "$NODE_RANK" --role rank --tee 3
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
(trap '' USR1; exec "${launcher[@]}" --local-ranks-filter "$LOG_RANK" --log-dir "$DUMP_FOLDER/logs" \
  -m flame.train "$@" \
  2> >(awk -v launcher_log="$launcher_log" -v last_line="$last_line" '
    /^\[[A-Za-z_]+[0-9]+\]:/ { print; fflush(); last = $0; next }
    { print >> launcher_log; fflush(launcher_log) }
    END { print last > last_line }' >&2)) &
launcher_pid=$!
# wait returns early when a trapped signal arrives: wait again until the launcher has ended.
while :; do
  wait "$launcher_pid"
  rc=$?
  kill -0 "$launcher_pid" 2>/dev/null || break
done
# The filter writes the last rank line once the launcher's stderr closes.
for _ in $(seq 50); do [ -s "$last_line" ] && break; sleep 0.1; done
if [ -f "$preempted_marker" ]; then
  echo "Preempted: saved $(cat "$preempted_marker"); launch the same command again to resume (exit status 75)" >&2
  exit 75
fi
if [ -n "$signalled" ] && [ "$rc" -ne 0 ]; then
  echo "Stopped by SIG$signalled before a checkpoint was saved; a new launch resumes from the latest one (exit status 76)" >&2
  exit 76
fi

# A failed run ends on its reason: the refusal shown last, else the first rank's refusal from its log (a rank the
# console does not show, LOG_RANK), else, where no rank was killed by a signal, the exception that ended the first
# rank that raised one (the "Type: message" line after its log's last "Traceback", without the rank prefix of
# torch's excepthook), else one line on how it ended and where the reports are.
exception_line='^(\[rank[0-9]+\]: ?)?([A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*(Error|Exception|Interrupt)(: .*)?$'
if [ "$rc" -ne 0 ] && ! grep -Eq '^\[[A-Za-z_]+[0-9]+\]:error: ' "$last_line"; then
  attempt=$(ls -td "$DUMP_FOLDER"/logs/*/attempt_*/ 2>/dev/null | head -1)
  code=$(tail -c "+$launcher_log_start" "$launcher_log" 2>/dev/null | grep -m1 -o 'exitcode *: *-*[0-9]*' |
    grep -o -- '-*[0-9]*$')
  refusal=""
  raised=""
  for ((local_rank = 0; local_rank < NGPU; local_rank++)); do
    rank_log="${attempt}${local_rank}/stderr.log"
    line=$(grep -m1 '^error: ' "$rank_log" 2>/dev/null)
    if [ -n "$line" ]; then
      refusal="[rank$((NODE_RANK * NGPU + local_rank))]:$line"
      break
    fi
    if [ -z "$raised" ] && [ "${code:-1}" -ge 0 ]; then
      line=$(pattern="$exception_line" awk '/Traceback \(most recent call last\):/ { traceback = 1; found = "" }
        traceback && $0 ~ ENVIRON["pattern"] { found = $0 } END { print found }' "$rank_log" 2>/dev/null |
        sed -E 's/^\[rank[0-9]+\]: ?//' | cut -c1-400)
      if [ -n "$line" ]; then
        raised="error: training failed: rank $((NODE_RANK * NGPU + local_rank)) raised $line; its traceback is in"
        raised="$raised $rank_log, the launcher's report in $launcher_log"
      fi
    fi
  done
  if [ -n "$refusal" ]; then
    echo "$refusal" >&2
  elif [ -n "$raised" ]; then
    echo "$raised" >&2
  else
    echo "error: training failed: a rank ended${code:+ with exit code $code} without a message (killed, out of" \
      "memory or crashed); every rank's output is in $DUMP_FOLDER/logs, the launcher's report in $launcher_log" >&2
  fi
fi

exit "$rc"
