"""Every model family trained through train.sh on one GPU and measured: the family table of docs/models.md.

    python bench/families.py                                   # every family, ~100-150M parameters, on one GPU
    python bench/families.py --families gla,llama --steps 30   # some of them
    python bench/families.py --size tiny --families llama --steps 4 --seq_len 64 --batch_size 2   # CPU smoke test
    python bench/families.py --gpus 8 --families missing      # the families without a row yet, 8 at a time

Families: every model type FLA 0.6.0 declares (flame's own implementation for transformer, gated_deltanet and
delta_net, FLA's class through the generic family for the others) and transformers' llama, qwen2, qwen3,
qwen3_next, mistral, olmo2, olmo3, olmo_hybrid and gemma3_text. ``--size small`` gives each a hidden-768,
12-layer config (vocabulary 4096, the shipped tokenizer's) with the fields it requires filled in; flame's own
families take their ``configs/*_340M.json``. ``--size tiny`` is a few-million-parameter version for smoke tests.

Per family, each step is its own subprocess with its own timeout (``--timeout_s``), and a failed step ends that
family's row with its reason (the last line of its output, and the upstream issue where the message is a known one,
``KNOWN_REASONS``):

1. train: ``NGPU=1 bash train.sh`` for ``--steps`` steps on the shipped corpus and tokenizer (``DEFAULT_DATASET``),
   a checkpoint half-way and at the end, ``--metrics.log_freq 1``, ``--compile.enable`` on a GPU. Its TensorBoard
   events give the loss of every step, tokens/s, MFU and peak memory (flame/metrics.py). First-step seconds are
   the step-1 window (tokens per step / its tokens/s: compilation and FLA's Triton autotuning); tokens/s and MFU
   are the medians over the steps after the fifth (a checkpoint save falls into the next step's window). The loss
   falls when the mean of the last 5 steps is below the mean of the first 5.
2. resume: the half-way checkpoint copied into a new dump folder, train.sh again to the end; its losses against
   the uninterrupted run's. On a CPU they must be equal; on a GPU compiled kernels need not be deterministic, so
   the maximum relative difference is reported and called equal within ``GPU_RESUME_RTOL``.
3. export: ``python -m flame.cli.convert_dcp_to_hf`` (train.sh's end-of-run converter) writes the HF folder; a
   fresh process loads it with ``AutoModelForCausalLM.from_pretrained`` (after ``import fla`` for FLA's types,
   and after flame has built its model, so FLA's modules carry flame's fixes as in any process that imports flame:
   flash-attn's functions on flame's attention, rodimus' residual flag; flame.compat) and compares its float32 logits on a fixed batch with those of flame's model read from the DCP checkpoint
   (flame.hf.load): the max |difference| over the max |logit| within ``EXPORT_RTOL`` of the device.
4. anchor: ``run_naive_hf_loop`` of bench/train_throughput.py on the same model and tokens per step (random
   tokens), in a fresh process: the loop a user writes without flame (eager, bf16 autocast, fused AdamW); the ratio
   column is flame's tokens/s over it.

The table is printed; on a GPU (or with ``--write_doc``) it is written into docs/models.md between
``<!-- bench_families -->`` markers with the command, device and date, after every family, so a run stopped
part-way keeps the rows it finished. A run of some families replaces their rows and keeps the others', each run
listed with the families it measured, so the table can be built a few families at a time, and runs on different
GPUs of one machine (``CUDA_VISIBLE_DEVICES``) can share the doc: each merges its rows under a lock on the file.
``--gpus N`` runs N families at once, each in a worker process of this script on a GPU of its own, the next family
starting on a GPU as soon as one ends; this process alone writes the doc. ``--families missing`` takes the families
without a row in the doc. ``--merge A.md B.md`` brings the tables of docs written elsewhere (another machine's copy) into ``--doc``.
Triton's autotuning cache is the machine's, so a kernel that an earlier family tuned is not tuned again in a later
family's first step. ``--write_doc`` off by default on a CPU keeps smoke runs' numbers out of the doc. Each family's runs
stay under ``--work``/<family> (logs, TensorBoard events); their checkpoints and export are removed unless
``--keep_runs`` (a ~150M model's take gigabytes). The script exits 0 whatever the families do; 2 on bad options.
"""

import argparse
import dataclasses
import fcntl
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from train_throughput import (  # noqa: E402
    DEFAULT_DATASET,
    DEFAULT_TOKENIZER,
    H100_BF16_PEAK_TFLOPS,
    command_line,
    device_name,
    run_naive_hf_loop,
    section_in,
    write_section,
)

MODELS_DOC = REPO / "docs" / "models.md"
MARKER = "bench_families"
TRANSFORMERS_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_next", "mistral", "olmo2", "olmo3", "olmo_hybrid",
                         "gemma3_text")  # fmt: skip
FLAME_CONFIGS = {
    "transformer": "configs/transformer_340M.json",
    "gated_deltanet": "configs/gated_deltanet_340M.json",
    "delta_net": "configs/delta_net_340M.json",
}
VOCAB = 4096  # the shipped tokenizer's
FLA_SHAPE = {
    "tiny": {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2},
    "small": {"vocab_size": VOCAB, "hidden_size": 768, "num_hidden_layers": 12},
}
HF_SHAPE = {
    "tiny": {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    "small": {"vocab_size": VOCAB, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4},
}  # fmt: skip
# Fields a family needs at these widths, beyond the shape: FLA's defaults sized for wider models (heads of
# expand_ratio channels), required sub-configs, Samba's attention heads, Mamba's depth, head widths that are not hidden / heads, Qwen3-Next's
# 512 experts, and special token ids past the 4096-token vocabulary (which would be nn.Embedding's padding_idx).
FIELDS = {
    "tiny": {
        "transformer": {"num_heads": 4},
        "gated_deltanet": {"num_heads": 2, "head_dim": 32},
        "delta_net": {"num_heads": 2},
        "hgrn2": {"expand_ratio": 16},
        "lightnet": {"expand_ratio": 16},
        "rodimus": {"ska_attn": {"num_heads": 4}},
        "path_attn": {"num_heads": 4},
        "deltaformer": {"num_heads": 4},
        "samba": {"attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 4, "window_size": 2048}},
        "qwen3": {"head_dim": 16},
        "gemma3_text": {"head_dim": 16},
        "qwen3_next": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                       "shared_expert_intermediate_size": 64, "linear_num_key_heads": 2,
                       "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
        "olmo_hybrid": {"pad_token_id": None, "eos_token_id": None},
    },
    "small": {
        "rodimus": {"ska_attn": {"num_heads": 12}},
        # PaTH attention's kernel takes heads of 16, 32, 64 or 128 channels; FLA's default 32 heads give 24.
        "path_attn": {"num_heads": 12},
        # DeltaFormer's kernels take power-of-2 head widths; FLA's default 8 heads give 96.
        "deltaformer": {"num_heads": 12},
        # Samba's default attention has 18 heads (its 1B model's 2304 / 128): 12 of 64 here, every other layer.
        "samba": {"attn": {"layers": [1, 3, 5, 7, 9, 11], "num_heads": 12, "num_kv_heads": 12, "window_size": 2048}},
        # Mamba's blocks have no MLP: 24 of them, as Mamba's 130M model has.
        "mamba": {"num_hidden_layers": 24},
        "mamba2": {"num_hidden_layers": 24},
        "mamba3": {"num_hidden_layers": 24},
        "qwen3": {"head_dim": 64},
        "gemma3_text": {"head_dim": 64},
        "qwen3_next": {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384,
                       "shared_expert_intermediate_size": 384, "linear_num_key_heads": 6,
                       "linear_num_value_heads": 12, "linear_key_head_dim": 64, "linear_value_head_dim": 64},
        "olmo_hybrid": {"pad_token_id": None, "eos_token_id": None},
    },
}  # fmt: skip
LEARNING_RATE = 1e-3
# Families that diverge at LEARNING_RATE, with the rate their row trains at and why (the row's note says both).
LEARNING_RATES = {
    "deltaformer": (
        3e-4,
        "FLA's layer feeds b_proj's output to its kernel as beta, unbounded: at 1e-3 the loss is NaN from step 10",
    ),
}
# Messages whose cause is known: (pattern searched in a failed step's output, the reason the row gives).
KNOWN_REASONS = (
    (r"flash_attn|flash-attn|FlashAttention",
     "needs flash-attn, which flame does not install (FLA's attention layers import it when built)"),
    (r"see #640", "FLA's Hopper guard on its gated backward (fla-org/flash-linear-attention#640)"),
    (r"CompilationError", "Triton CompilationError in FLA's kernels"),
    (r"active drivers|Triton is not supported|Found no NVIDIA driver|Torch not compiled with CUDA",
     "FLA's Triton kernels need a GPU"),
    # FLA's own fallback (a traceback through FLA's layer file): flame's layers for them have methods of these names
    (r"fla/layers/mamba2?\.py\", line \d+, in (slow_forward|torch_forward)\b",
     "FLA's Mamba layers ran their PyTorch fallback: the fast path needs mamba_ssm and causal_conv1d, CUDA extensions "
     "that flame does not install (the package index has no wheels of them)"),
    (r"OutOfMemoryError|CUDA out of memory", "out of memory"),
)  # fmt: skip
CPU_RESUME_RTOL = 0.0  # the same float32 ops in the same order: bit for bit
GPU_RESUME_RTOL = 1e-3  # compiled kernels with atomics or autotuned splits need not repeat bit for bit
EXPORT_RTOL = {"cpu": 1e-5, "cuda": 1e-2}  # float32 on both sides; on a GPU Triton kernels multiply in TF32
FIRST_STEPS = 5  # the loss and throughput windows


def fla_types() -> list[str]:
    from flame.models.generic.args import fla_model_types

    return sorted(fla_model_types())


def all_families() -> list[str]:
    return fla_types() + [f for f in TRANSFORMERS_FAMILIES if f not in fla_types()]


def family_config(family: str, size: str) -> dict:
    """The family's config at ``size``: flame's 340M config for its own families (small), else the shape with the
    fields the family requires."""
    from flame.models import read_model_config

    if size == "small" and family in FLAME_CONFIGS:
        return read_model_config(REPO / FLAME_CONFIGS[family])
    shape = HF_SHAPE[size] if family in TRANSFORMERS_FAMILIES else FLA_SHAPE[size]
    return {"model_type": family, **shape, **FIELDS[size].get(family, {})}


@dataclass
class Row:
    family: str
    params: int = 0
    first_step_s: float = float("nan")
    tokens_per_s: float = float("nan")
    mfu: float = float("nan")
    peak_gib: float = float("nan")
    loss_first: float = float("nan")
    loss_last: float = float("nan")
    loss_falls: bool = False
    resume: str = "n/a"
    export: str = "n/a"
    anchor_tokens_per_s: float = float("nan")
    note: str = ""

    def add_note(self, text: str) -> None:
        self.note = "; ".join(filter(None, [self.note, text]))


class StepFailed(Exception):
    """A step of a family failed; the message is the row's reason."""


# A train.sh log line's step and throughput: "step  7/30  loss ... tok/s 436 ...".
STEP_LINE = re.compile(r"step\s+(\d+)/(\d+)\b.*?tok/s\s+([\d,]+)")


def reason_of(output: str) -> str:
    """The last exception line of a failed step's output (``SomeError: message``, without torchrun's rank prefixes;
    dynamo follows its errors with advice lines), else its last non-empty line, after the known reason when the
    output matches one. A step that timed out says how far its training had got (its last logged step)."""
    lines = [re.sub(r"^(\[rank\d+\]:)+", "", line).strip() for line in output.splitlines()]
    final = next((line for line in reversed(lines) if line), "")
    if re.fullmatch(r"timed out after \d+ s", final):
        logged = STEP_LINE.findall(output)
        if not logged:
            return f"{final}, before its first logged step"
        number, total, tokens_per_s = logged[-1]
        return f"{final}, at step {number} of {total} ({tokens_per_s} tokens/s)"
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    last = errors[-1] if errors else next((line for line in reversed(lines) if line), "no output")
    for pattern, reason in KNOWN_REASONS:
        if re.search(pattern, output):
            return f"{reason}: {last}"
    return last


def run_command(command: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one step's subprocess, both kept in ``log``; status 124 when it timed
    out. The step runs in its own process group, all of which a timeout kills, and so does this script's own end
    (SIGTERM: ``stop_on_sigterm``): train.sh's launcher and ranks would otherwise outlive it and hold the GPU."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               env={**os.environ, **env}, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        status = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        status, stderr = 124, stderr + f"\ntimed out after {timeout_s:.0f} s"
    except BaseException:  # this script stopped (SIGTERM, Ctrl-C): its step's processes go with it
        os.killpg(process.pid, signal.SIGKILL)
        raise
    log.write_text(stdout + stderr)
    return status, stdout, stderr


def stop_on_sigterm() -> None:
    """SIGTERM (``timeout``'s signal) exits through Python's unwinding, so the running step's launcher kills it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def step(
    name: str,
    command: list[str],
    folder: Path,
    args,
    env: dict[str, str] | None = None,
    dump: Path | None = None,
) -> str:
    """Runs one step's command; its standard output, or StepFailed with its reason. A train.sh whose rank died
    without a refusal ends on where its logs are: the reason is then the rank's own last line (``dump``'s logs)."""
    started = time.perf_counter()
    status, stdout, stderr = run_command(command, folder / f"{name}.log", args.timeout_s, env or {})
    print(f"{folder.name} {name}: {time.perf_counter() - started:.0f} s (status {status})", flush=True)
    if status != 0:
        output = stdout + stderr
        if dump is not None and "without a message" in reason_of(output):
            output += "".join(
                log.read_text() for log in sorted((dump / "logs").glob("*/attempt_*/*/stderr.log"))
            )
        raise StepFailed(f"{name}: {reason_of(output)}")
    return stdout


def learning_rate(family: str, args) -> tuple[float, str]:
    """The family's learning rate and, where it is not the bench's, the row's note on why: ``--lr``, else the
    family's entry in LEARNING_RATES, else LEARNING_RATE."""
    if args.lr is not None:
        return args.lr, ""
    lr, why = LEARNING_RATES.get(family, (LEARNING_RATE, ""))
    return lr, why and f"learning rate {lr:g}: {why}"


def train_command(dump: Path, config: Path, lr: float, args) -> list[str]:
    flags = ["--job.dump_folder", str(dump), "--model.config", str(config),
             "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
             "--training.batch_size", str(args.batch_size), "--training.seed", "42",
             "--training.dataset", str(args.dataset), "--model.tokenizer_path", str(args.tokenizer),
             "--optimizer.lr", str(lr), "--lr_scheduler.warmup_steps", str(max(1, args.steps // 6)),
             "--checkpoint.interval", str(args.steps // 2), "--metrics.log_freq", "1"]  # fmt: skip
    if args.device == "cuda":
        flags.append("--compile.enable")
    return ["bash", str(REPO / "train.sh"), *flags]


def train_env() -> dict[str, str]:
    """The environment of a one-GPU train.sh launch (which takes a free rendezvous port itself): no HF export at
    the end."""
    return {"NGPU": "1", "FLAME_EXPORT_HF": "0"}


def read_run(dump: Path) -> dict[str, dict[int, float]]:
    from flame.plot import read_scalars

    return read_scalars(dump / "tb")


def fill_training(row: Row, scalars: dict[str, dict[int, float]], tokens_per_step: int, steps: int) -> None:
    """Loss, first-step time, steady tokens/s, MFU and peak memory of the uninterrupted run."""
    losses = scalars["loss/train"]
    if sorted(losses) != list(range(1, steps + 1)):
        raise StepFailed(f"train: the events hold the losses of steps {sorted(losses)}, not 1-{steps}")
    window = min(FIRST_STEPS, steps // 2)
    first = statistics.fmean(losses[s] for s in range(1, window + 1))
    last = statistics.fmean(losses[s] for s in range(steps - window + 1, steps + 1))
    row.loss_first, row.loss_last, row.loss_falls = losses[1], losses[steps], last < first
    diverged = [s for s in range(1, steps + 1) if not math.isfinite(losses[s])]
    if diverged:
        before = f" (step {diverged[0] - 1}: {losses[diverged[0] - 1]:.2f})" if diverged[0] > 1 else ""
        row.add_note(f"the loss is not finite from step {diverged[0]}{before}")
    throughput = scalars["throughput/tokens_per_second_per_device"]
    row.first_step_s = tokens_per_step / throughput[1]
    steady = [s for s in throughput if s > min(FIRST_STEPS, steps - 1)]
    row.tokens_per_s = statistics.median(throughput[s] for s in steady)
    if "throughput/mfu_percent" in scalars:
        row.mfu = statistics.median(scalars["throughput/mfu_percent"][s] for s in steady)
    row.peak_gib = max(scalars["memory/peak_allocated_gib"].values())


def resume_verdict(expected: dict[int, float], resumed: dict[int, float], device: str) -> str:
    """'equal' or 'differs', with the max relative difference of the resumed steps' losses (those after the
    half-way checkpoint)."""
    steps = max(expected)
    if sorted(resumed) != list(range(steps // 2 + 1, steps + 1)):
        return f"failed: resumed steps {sorted(resumed)}"
    worst = max(abs(resumed[s] - expected[s]) / abs(expected[s]) for s in resumed)
    tolerance = GPU_RESUME_RTOL if device == "cuda" else CPU_RESUME_RTOL
    return f"{'equal' if worst <= tolerance else 'differs'} (max rel {worst:.1e})"


def export_logit_difference(dump: Path, step_number: int, device: str) -> tuple[float, float, str]:
    """(max |exported - flame's| logit, max |flame's logit|, the precision they ran in) on a fixed batch: the HF
    folder in ``dump`` loaded by transformers' AutoModelForCausalLM (FLA's types registered by ``import fla``, FLA's
    class built as flame builds it: fla_classes_as_flame_builds_them), flame's model from its DCP checkpoint."""
    from transformers import AutoModelForCausalLM

    import flame.hf
    from flame.hf.load import load, read_hf_config
    from flame.models.generic.args import fla_model_types, import_fla_models
    from flame.models.generic.model import fla_classes_as_flame_builds_them

    flame.hf.register()
    if read_hf_config(dump).get("model_type") in fla_model_types():
        import_fla_models()
    flame_model = load(dump, step=step_number, device=device).model
    with fla_classes_as_flame_builds_them():  # FLA's layers that need flash-attn: flame's, same parameters
        exported = AutoModelForCausalLM.from_pretrained(dump, dtype=torch.float32).to(device).eval()
    tokens = torch.randint(0, exported.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    # No key/value cache: FLA's PaTH attention asserts use_cache is off for a call without an attention mask.
    (theirs, ours), precision = compared_logits(
        lambda: (exported(tokens.to(device), use_cache=False).logits, flame_model(tokens.to(device))), device
    )
    return float((theirs - ours).abs().max()), float(ours.abs().max()), precision


def compared_logits(forward: Callable[[], tuple[torch.Tensor, ...]], device: str) -> tuple[tuple, str]:
    """``forward()``'s logits in float32, and "float32"; where a kernel refuses float32 (FLA's stick-breaking
    attention takes half precision only), under bf16 autocast, and which error the float32 forward raised."""
    try:
        with torch.no_grad():
            return tuple(logits.float() for logits in forward()), "float32"
    except (TypeError, RuntimeError, AssertionError, ValueError) as error:
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            logits = tuple(logits.float() for logits in forward())
        return logits, f"bf16 autocast, float32 refused: {type(error).__name__}"


def export_verdict(difference: float, scale: float, device: str, precision: str = "float32") -> str:
    relative = difference / max(scale, 1e-12)
    where = "" if precision == "float32" else f"; {precision}"
    return (
        f"{'pass' if relative <= EXPORT_RTOL[device] else 'fail'} (max diff {difference:.1e}, rel {relative:.1e}"
        f"{where})"
    )


def anchor_tokens_per_s(config: Path, seq_len: int, batch_size: int, steps: int, device: str) -> float:
    """run_naive_hf_loop on the family's config: the same tokens per step, 2 warm-up then ``steps`` timed steps."""
    from flame.models import model_args_from_dict, read_model_config

    margs, _ = model_args_from_dict(read_model_config(config))
    options = argparse.Namespace(tokens_per_gpu=seq_len * batch_size, cp=1, warmup=2, steps=steps,
                                 peak_tflops=None, tiny=False, profile=0)  # fmt: skip
    return run_naive_hf_loop(
        margs.model_type, seq_len, options, torch.device(device), margs=margs
    ).tokens_per_s


def parameter_count(config: dict, seq_len: int) -> int:
    """The model's parameter count as the trainer counts it, built on the meta device (a family that cannot be
    built fails here, before any process starts)."""
    from flame.models import build_model, model_args_from_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, _ = model_args_from_dict(config)
        with torch.device("meta"):
            nparams, _ = args.get_nparams_and_flops(build_model(args), seq_len)
    return nparams


def run_family(family: str, args) -> Row:
    """The family's row: train, resume, export and anchor, each in its own process, stopping at the first failure."""
    row = Row(family)
    folder = args.work / family
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    script = [sys.executable, str(Path(__file__).resolve())]
    try:
        config = family_config(family, args.size)
        config_path = folder / "config.json"
        config_path.write_text(json.dumps(config, indent=2))
        try:
            row.params = parameter_count(config, args.seq_len)
        except Exception as e:
            raise StepFailed(f"build: {reason_of(f'{type(e).__name__}: {e}')}") from e
        dump, resumed = folder / "run", folder / "resumed"
        lr, why = learning_rate(family, args)
        row.add_note(why)
        step("train", train_command(dump, config_path, lr, args), folder, args, train_env(), dump)
        expected = read_run(dump)
        fill_training(row, expected, args.seq_len * args.batch_size, args.steps)

        half = f"step-{args.steps // 2}"
        shutil.copytree(dump / "checkpoint" / half, resumed / "checkpoint" / half)
        step("resume", train_command(resumed, config_path, lr, args), folder, args, train_env(), resumed)
        row.resume = resume_verdict(expected["loss/train"], read_run(resumed)["loss/train"], args.device)

        step(
            "export", [sys.executable, "-m", "flame.cli.convert_dcp_to_hf", "--path", str(dump)], folder, args
        )
        output = step("compare", [*script, "--compare_export", str(dump), "--step", str(args.steps),
                                  "--device", args.device], folder, args)  # fmt: skip
        difference, scale, precision = json.loads(output.strip().splitlines()[-1])
        row.export = export_verdict(difference, scale, args.device, precision)

        output = step("anchor", [*script, "--anchor_of", str(config_path), "--seq_len", str(args.seq_len),
                                 "--batch_size", str(args.batch_size), "--anchor_steps", str(args.anchor_steps),
                                 "--device", args.device], folder, args)  # fmt: skip
        row.anchor_tokens_per_s = float(output.strip().splitlines()[-1])
    except StepFailed as e:
        row.add_note(str(e))
    except Exception as e:  # reading a step's results failed: this row says so, the other families still run
        traceback.print_exc()
        row.add_note(f"reading the results: {type(e).__name__}: {e}")
    finally:
        if (
            not args.keep_runs
        ):  # a small model's checkpoints and export take GBs: keep the logs and events only
            for path in [*folder.glob("*/checkpoint"), *folder.glob("run/*.safetensors")]:
                # A killed step's checkpoint writer (async save) may still be adding files: not this row's business.
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return row


ROW_PREFIX = "family row: "
POLL_S = 1.0


def worker_command(family: str, args) -> list[str]:
    """One family in a process of its own, its row printed as JSON (``--row_json``) and not written to the doc."""
    options = ["--size", args.size, "--steps", str(args.steps), "--seq_len", str(args.seq_len),
               "--batch_size", str(args.batch_size), "--anchor_steps", str(args.anchor_steps),
               "--timeout_s", str(args.timeout_s), "--dataset", str(args.dataset), "--tokenizer", str(args.tokenizer),
               "--work", str(args.work), "--device", args.device]  # fmt: skip
    if args.lr is not None:
        options += ["--lr", str(args.lr)]
    return [sys.executable, str(Path(__file__).resolve()), *options, *["--keep_runs"] * args.keep_runs,
            "--families", family, "--no-write_doc", "--row_json"]  # fmt: skip


def worker_row(family: str, status: int, log: Path) -> Row:
    """The row a worker printed, or one that says how the worker ended without it."""
    lines = log.read_text().splitlines() if log.exists() else []
    printed = [line[len(ROW_PREFIX) :] for line in lines if line.startswith(ROW_PREFIX)]
    if printed:
        return Row(**json.loads(printed[-1]))
    reason = reason_of("\n".join(lines))
    return Row(family, note=f"its process ended (status {status}) without a row ({log}): {reason}")


def run_on_gpus(args, finished: Callable[[Row, float], None]) -> None:
    """The families, ``args.gpus`` at a time: each in a worker process (worker_command) on a GPU of its own (the
    visible ones in order), the next family starting on a GPU as soon as its previous family ends. Each worker's
    output goes to ``args.work``/<family>.log. Stopping this process (SIGTERM) stops the workers, which stop their
    steps."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",")[: args.gpus] if visible else [str(i) for i in range(args.gpus)]
    pending, running, free = list(args.family_list), {}, list(gpus)
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        while pending or running:
            if args.start_until_s is not None and time.perf_counter() - args.started > args.start_until_s:
                pending.clear()  # a lent machine's time limit: no family starts that could not finish
            while pending and free:
                gpu, family = free.pop(0), pending.pop(0)
                log = args.work / f"{family}.log"
                with open(log, "w") as output:
                    process = subprocess.Popen(worker_command(family, args), stdout=output, stderr=subprocess.STDOUT,
                                               cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})  # fmt: skip
                running[gpu] = (process, family, time.perf_counter(), log)
            time.sleep(POLL_S)
            for gpu, (process, family, started, log) in list(running.items()):
                if process.poll() is not None:
                    del running[gpu]
                    free.append(gpu)
                    finished(worker_row(family, process.returncode, log), time.perf_counter() - started)
    finally:
        for process, *_ in running.values():
            process.terminate()
        for process, *_ in running.values():
            process.wait()


def number(value: float, spec: str) -> str:
    return format(value, spec) if value == value else "n/a"


def table(rows: list[Row]) -> str:
    lines = ["| family | params | first step s | tokens/s | MFU | peak GiB | loss first -> last | resume | export | "
             "anchor tokens/s | ratio | note |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|---|"]  # fmt: skip
    for r in rows:
        params = f"{r.params / 1e6:.1f}M" if r.params else "n/a"
        loss = "n/a" if r.loss_first != r.loss_first else (
            f"{r.loss_first:.2f} -> {r.loss_last:.2f} ({'falls' if r.loss_falls else 'does not fall'})")  # fmt: skip
        ratio = number(r.tokens_per_s / r.anchor_tokens_per_s, ".2f") + "x" * (r.anchor_tokens_per_s > 0)
        note = r.note.replace("|", "\\|")
        lines.append(
            f"| {r.family} | {params} | {number(r.first_step_s, '.1f')} | {number(r.tokens_per_s, ',.0f')} | "
            f"{number(r.mfu, '.1f')}{'%' * (r.mfu == r.mfu)} | {number(r.peak_gib, '.2f')} | {loss} | {r.resume} | "
            f"{r.export} | {number(r.anchor_tokens_per_s, ',.0f')} | {ratio} | {note} |"
        )
    return "\n".join(lines)


def legend(args) -> str:
    resume_rule = (f"equal within a relative {GPU_RESUME_RTOL:g} on a GPU (compiled kernels need not repeat bit "
                   "for bit), bit for bit on a CPU")  # fmt: skip
    return (
        "`NGPU=1 bash train.sh` on the shipped corpus (`flame/assets/corpus`, 4096-token tokenizer), compiled on a "
        "GPU, a checkpoint half-way and at the end. First step s: the first step's time with compilation and "
        f"FLA's autotuning; tokens/s, MFU (against {H100_BF16_PEAK_TFLOPS} TFLOP/s) and peak GiB (allocated): "
        f"the medians over the steps after the {FIRST_STEPS}th and the peak; the loss falls when the mean of the "
        f"last {FIRST_STEPS} steps is below that of the first {FIRST_STEPS}. Resume: from the half-way checkpoint "
        f"to the end, the losses {resume_rule}. Export: the HF folder loaded by transformers against flame's model "
        f"from the DCP checkpoint, float32 logits, pass within {EXPORT_RTOL['cuda']:g} (GPU: Triton kernels "
        f"multiply in TF32) or {EXPORT_RTOL['cpu']:g} (CPU) of the largest logit. Anchor: `run_naive_hf_loop` of "
        "bench/train_throughput.py (the export's class, eager, bf16 autocast, fused AdamW, random tokens, the "
        "same tokens per step; an FLA class with the layers flame builds it with where FLA's need flash-attn or "
        "mamba_ssm, which flame does not install: the same model); ratio: flame's tokens/s over it. The export "
        "check builds FLA's class the same way. Each row comes from the run below that names its "
        "family (a run of some families keeps the other rows)."
    )


RUN_LINE = re.compile(r"^- run: .*: (?P<families>[^:]*)$")


def section_of(text: str) -> tuple[dict[str, str], list[str]]:
    """(row line by family, run lines) of the family table section in a doc's ``text``."""
    section = section_in(text, MARKER)
    rows = {line.split("|")[1].strip(): line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| family |")}  # fmt: skip
    return rows, [line for line in section.splitlines() if RUN_LINE.match(line)]


def merged_section(sources: list[tuple[dict[str, str], list[str]]], args) -> tuple[str, str]:
    """(description, table) of the section from ``sources`` of (rows by family, run lines), oldest first: a
    family's row is the newest source's, and a source's run lines stay while some family of theirs keeps that
    source's row."""
    rows, origin = {}, {}
    for index, (source_rows, _) in enumerate(sources):
        rows.update(source_rows)
        origin.update(dict.fromkeys(source_rows, index))
    runs = [line for index, (_, lines) in enumerate(sources) for line in lines
            if any(origin.get(f) == index for f in RUN_LINE.match(line)["families"].split(", "))]  # fmt: skip
    order = all_families() + sorted(set(rows) - set(all_families()))
    header = table([]).splitlines()
    missing = [f for f in all_families() if f not in rows]
    runs += [f"\nNo row yet (not run): {', '.join(missing)}."] if missing else []
    return "\n".join([legend(args), "", *runs]), "\n".join(header + [rows[f] for f in order if f in rows])


def runs_since(
    source: tuple[dict[str, str], list[str]], known_runs: list[str]
) -> tuple[dict[str, str], list[str]]:
    """A copy's run lines that ``known_runs`` (the doc's) lack and the rows of the families they name: a copy made
    from the doc also holds the doc's rows of that time, which must not come back over rows measured since."""
    rows, runs = source
    new = [line for line in runs if line not in known_runs]
    named = {family for line in new for family in RUN_LINE.match(line)["families"].split(", ")}
    return {family: row for family, row in rows.items() if family in named}, new


def write_sources(doc: Path, sources: list[tuple[dict[str, str], list[str]]], args) -> None:
    """Merges ``sources`` over ``doc``'s own section under an exclusive lock on the doc, so that runs on
    different GPUs of one machine, each writing as its families finish, keep each other's rows."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    with open(doc, "a") as locked:
        fcntl.flock(locked, fcntl.LOCK_EX)  # released when closed; write_section rewrites the same file
        merged = merged_section([section_of(doc.read_text()), *sources], args)
        write_section(doc, MARKER, "The family table", *merged)


def run_source(rows: list[Row], run_line: str) -> tuple[dict[str, str], list[str]]:
    """This run's rows and run line as a source of the section."""
    return {r.family: line for r, line in zip(rows, table(rows).splitlines()[2:])}, [run_line]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        default=None,
        help="comma separated model types, or 'missing' for those without a row in --doc (default: every family)",
    )
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--steps", type=int, default=30, help="training steps (even; a checkpoint half-way)")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"every family's (default: {LEARNING_RATE:g}, or LEARNING_RATES')",
    )
    parser.add_argument("--anchor_steps", type=int, default=10, help="timed steps of the naive HF loop")
    parser.add_argument("--timeout_s", type=float, default=600, help="per step of a family")
    parser.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--work", type=Path, default=Path("exp/bench_families"), help="runs' dump folders")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    parser.add_argument(
        "--keep_runs",
        action="store_true",
        help="keep each family's checkpoints and export (default: removed)",
    )
    parser.add_argument("--doc", type=Path, default=MODELS_DOC, help="markdown file to write the table into")
    parser.add_argument(
        "--write_doc",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write the table into --doc (default: on CUDA only, so that CPU smoke runs leave the doc alone)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="run this many families at once, each in its own process on its own GPU (CUDA_VISIBLE_DEVICES)",
    )
    parser.add_argument(
        "--start_until_s",
        type=float,
        default=None,
        help="with --gpus: start no family after this many seconds (the families running then finish)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="write into --doc the rows that the runs of these docs (copies on other machines) measured and --doc "
        "lacks, later ones over earlier",
    )
    # The steps that run in a fresh process of this script.
    parser.add_argument("--compare_export", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--anchor_of", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row_json", action="store_true", help=argparse.SUPPRESS)  # a --gpus worker's rows
    args = parser.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        parser.error(
            f"--steps {args.steps}: give an even number of at least 2 (a checkpoint is taken half-way)"
        )
    args.started = time.perf_counter()
    args.work = args.work.resolve()  # the steps run from the repository
    if args.gpus < 1:
        parser.error(f"--gpus {args.gpus}: give the number of GPUs to use, at least 1")
    if args.families is None:
        args.family_list = all_families()
    elif args.families == "missing":  # the families without a row in the doc yet
        rows = section_of(args.doc.read_text())[0] if args.doc.exists() else {}
        args.family_list = [family for family in all_families() if family not in rows]
    else:
        args.family_list = args.families.split(",")
    if args.write_doc is None:
        args.write_doc = args.device == "cuda"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.compare_export is not None:
        print(json.dumps(export_logit_difference(args.compare_export, args.step, args.device)))
        return 0
    if args.anchor_of is not None:
        print(
            anchor_tokens_per_s(args.anchor_of, args.seq_len, args.batch_size, args.anchor_steps, args.device)
        )
        return 0
    if args.merge:
        known_runs = section_of(args.doc.read_text())[1] if args.doc.exists() else []
        write_sources(
            args.doc, [runs_since(section_of(path.read_text()), known_runs) for path in args.merge], args
        )
        return 0
    stop_on_sigterm()
    started = time.perf_counter()
    command = command_line("bench/families.py", argv)
    rows = []

    def finished(row: Row, seconds: float) -> None:
        rows.append(row)
        print(table([row]).splitlines()[-1], f"({seconds:.0f} s)", flush=True)
        if args.row_json:
            print(ROW_PREFIX + json.dumps(dataclasses.asdict(row)), flush=True)
        if args.write_doc:  # after every family: a run stopped part-way keeps the rows it finished
            run_line = (f"- run: `{command}` on {device_name(torch.device(args.device))}, torch "
                        f"{torch.__version__}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f} s: "
                        + ", ".join(r.family for r in rows))  # fmt: skip
            write_sources(args.doc, [run_source(rows, run_line)], args)

    if args.gpus > 1:
        run_on_gpus(args, finished)
    else:
        for family in args.family_list:
            family_start = time.perf_counter()
            finished(run_family(family, args), time.perf_counter() - family_start)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
