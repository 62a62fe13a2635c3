"""The speed table: train.sh against the bench, the first step, the 340M models' throughput and MFU, long context and
tokens to a loss, each beside its anchor measured in the same run, on one GPU, by one command.

    python bench/speed.py --json /tmp/speed.json                       # every part, one GPU (~40 min)
    python bench/speed.py --json /tmp/speed.json --gpus 4              # every part, at once on 4 GPUs (~15 min)
    python bench/speed.py --json /tmp/speed.json --parts long_context  # some parts; the others' results are kept
    python bench/speed.py --json /tmp/speed.json --parts long_context --resume  # what a stopped run did not finish
    python bench/speed.py --json /tmp/speed.json --parts long_context --rerun hybrid  # one model's launch again
    python bench/speed.py --json /tmp/speed.json --parts ""            # the table of the parts measured
    python bench/speed.py --tiny --device cpu --parts throughput,train_sh --json /tmp/s.json --no_write  # smoke

Parts (``--parts``), each a run of another bench script or of train.sh, in this order:

- ``throughput``: bench/train_throughput.py on random tokens, compiled, 8 x 2048, with ``--anchor`` (the naive HF
  loop of the same model) and one profiled step (the top kernels say what limits a row), for the transformer,
  GatedDeltaNet and the hybrid; and the transformer at twice the micro-batch (16 x 2048), for its MFU.
- ``train_sh``: ``NGPU=1 bash train.sh`` of the same models and shapes on the shipped corpus, ``--steps`` steps: the
  tokens/s, data share, MFU and peak memory of its log lines from ``--skip_steps`` on (the mean; the peak's
  largest), from its TensorBoard events.
- ``train_sh_graphs``: the same launches with ``--compile.mode reduce-overhead`` (the compiled blocks replayed as
  CUDA graphs; a CUDA GPU only), beside the default mode's for items 3 and 4.
- ``train_sh_no_block_graphs``: the same launches with ``--compile.no-graph_compiled_blocks`` (the compiled blocks
  run without the CUDA graphs that replay them by default; a CUDA GPU only), beside the default mode's for items 3
  and 4.
- ``torchtitan``: torchtitan's own trainer on a Llama3 of the transformer's shape (bench/torchtitan_anchor.py), the
  transformer's second anchor.
- ``first_step``: bench/first_step.py's four launches (fresh; fresh with flame's shipped tuning, without and with
  train.sh's kernel prewarm; warm) of GatedDeltaNet, the transformer and the hybrid.
- ``long_context``: the seed recipe's 64k-token varlen job (batch 1 x 65,536, documents cut at 4,096) of the three
  models with full activation checkpointing and with offloading, one bench launch per model; an offloading row's
  anchor is full checkpointing in the same launch.
- ``tokens_to_loss``: bench/tokens_to_loss.py's AdamW and Muon runs of the 340M transformer on ``--t2l_dataset``
  (``python scripts/build_code_corpus.py --out exp/code_corpus`` builds the default one).

``--json`` keeps every part's results (a part run again replaces its own), so a run stopped part-way continues
with the parts left, and runs of different parts on the GPUs of one machine can share it (each reads it again
before writing, under a lock). ``--gpus N`` is such a run by one command: the parts are spread over N GPUs of this
machine, longest first, and each GPU's parts run in a process of their own that sees that GPU alone
(``CUDA_VISIBLE_DEVICES``) and an equal, disjoint share of this process's CPU cores, as a one-GPU machine of the
host's size would have (a part's time depends on the cores it has: a compiled step issued by the host, compiling,
data loading); the table then names this one command. From the parts there, the table has one row per measurement: what was measured, its anchor
from the same file, their ratio, the issue's target and whether it is met (or how far it is). It is printed and, on
a GPU (or with ``--write_doc``), written into docs/performance.md between ``<!-- bench_speed_<device> -->`` markers
(one table per device), each run named with its command, the items of its rows, its dates and torch. A run replaces
the rows of the items it measured; the section keeps the other items' rows and the runs that measured them, so parts
measured on one device in runs of different days (a GPU lent for less time than every part takes) make one table.

The first_step, train_sh, the two graph parts, long_context and tokens_to_loss parts are saved as each of their launches
ends; with ``--resume`` such a part run again keeps the launches its earlier runs finished (a model's every
first-step case or its train.sh run at the same shape, a model's every long-context case, an optimizer's run) and
runs the others: a part longer than one sitting on a GPU, or stopped by the sitting's end, is measured in two.
``--rerun NAMES`` (models, optimizers) is ``--resume`` that launches the named ones again though they finished. The
other parts are saved whole as they end, and ``--resume`` keeps those saved without an error, so one command,
``python bench/speed.py --json F --resume``, run again after each stop, measures every part once.
Each launch keeps the command, date and seconds of the run that made it, and the part is named by the runs of its
launches, earliest first: a run whose launches were all made again by later ones drops out of the table.
"""

import argparse
import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from families import stop_on_sigterm, train_env  # noqa: E402
from first_step import CASES as FIRST_STEP_CASES  # noqa: E402
from first_step import SHIPPED_VOCAB, measure_model, phase_text  # noqa: E402
from train_throughput import (  # noqa: E402
    add_doc_options,
    command_line,
    device_name,
    device_slug,
    model_config,
    section_in,
    write_section,
)

from flame.plot import read_scalar_events  # noqa: E402

MARKER = "bench_speed"  # one section per device: bench_speed_<device>
PARTS = (
    "throughput",
    "train_sh",
    "train_sh_graphs",
    "train_sh_no_block_graphs",
    "torchtitan",
    "first_step",
    "long_context",
    "tokens_to_loss",
)
MODELS = ("transformer", "gated_deltanet", "hybrid")
FIRST_STEP_MODELS = ("gated_deltanet", "transformer", "hybrid")  # the target's model first
LONG_CONTEXT_ACTIVATIONS = ("full", "offload")
OPTIMIZERS = ("AdamW", "Muon")  # tokens_to_loss's runs
# A launch of a part that its run, stopped (a device call's time limit), did not reach: --resume makes it.
NOT_RUN = "not run: the run stopped before this launch"
# The speed issue's targets on one H100 (tokens/s at 8 x 2048 through train.sh; MFU of the transformer; seconds to
# GatedDeltaNet's first step on a fresh machine).
TARGET_TOKENS_PER_S = {"gated_deltanet": 120_000, "hybrid": 140_000}
TARGET_MFU = 50.0
TARGET_FIRST_STEP_S = 60.0
TARGET_TRAIN_SH_RATIO = 0.97  # train.sh within 3% of the bench
TARGET_DATA_SHARE = 0.01


def run_logged(command: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
    """Runs ``command`` from the repo root with its output in ``log``; its exit status (124 past ``timeout_s``, when
    its whole process group is killed: train.sh's ranks too)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print("==", " ".join(command), flush=True)
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return 124
        except BaseException:  # stopped: the run goes with this process
            os.killpg(process.pid, signal.SIGKILL)
            raise


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def launch_each(names, kept_values: dict, launch, part, pending, progress, rerun) -> dict:
    """A resumable part's launches: ``launch(name)`` for each of ``names`` (in order) that ``kept_values`` (the
    launches an earlier run finished, which --resume keeps) lacks or ``rerun`` (--rerun) names. ``part(values)``
    makes the part's results from each name's value; ``progress`` is given them after each launch, with
    ``pending`` for the names not yet launched. The results add ``kept`` (the names kept) and ``launch_seconds``
    (each launch's seconds)."""
    kept = [name for name in names if name in kept_values and name not in rerun]
    values, launch_seconds = {name: kept_values[name] for name in kept}, {}
    for name in names:
        if name in kept:
            continue
        started = time.perf_counter()
        values[name] = launch(name)
        launch_seconds[name] = time.perf_counter() - started
        if progress:
            so_far = {name: values.get(name, pending) for name in names}
            progress({**part(so_far), "kept": kept, "launch_seconds": launch_seconds})
    return {**part({name: values[name] for name in names}), "kept": kept, "launch_seconds": launch_seconds}


def throughput_bench(args, work: Path, name: str, flags: list[str]) -> dict:
    """bench/train_throughput.py with ``flags``: its results (``results``), or why it failed (``error``)."""
    out = work / f"{name}.json"
    command = [sys.executable, "bench/train_throughput.py", "--device", args.device, "--no_write", "--json", str(out),
               *(["--tiny"] if args.tiny else []), *flags]  # fmt: skip
    status = run_logged(command, work / f"{name}.log", args.timeout_s)
    if not out.exists():
        return {"error": f"exit status {status}: {last_line(work / f'{name}.log')}"}
    return {"results": json.loads(out.read_text())["results"], "status": status}


def part_throughput(args, work: Path) -> dict:
    mode = "compiled" if args.device == "cuda" else "eager"  # as train.sh runs
    flags = ["--models", ",".join(MODELS), "--seq_lens", str(args.seq_len), "--modes", mode, "--anchor",
             "--tokens_per_gpu", str(args.seq_len * args.batch_size), "--warmup", str(args.warmup), "--steps",
             str(args.bench_steps)] + (["--profile", "1"] if args.device == "cuda" else [])  # fmt: skip
    # The transformer at twice the micro-batch: the issue's MFU target allows a larger batch where it is faster.
    larger = ["--models", "transformer", "--seq_lens", str(args.seq_len), "--modes", mode, "--tokens_per_gpu",
              str(2 * args.seq_len * args.batch_size), "--warmup", str(args.warmup), "--steps", str(args.bench_steps)]  # fmt: skip
    return {
        **throughput_bench(args, work, "throughput", flags),
        "mode": mode,
        "larger_batch": throughput_bench(args, work, "throughput_larger_batch", larger),
    }


def part_long_context(args, work: Path, earlier: dict | None = None, progress=None) -> dict:
    """One bench launch per model (``--timeout_s`` each, so that a slow model leaves the others their time): each
    model's results, and each launch's exit status or why it gave none (``launches``). A model whose every case
    ``earlier`` (this part's saved results, under ``--resume``) holds is not launched again unless ``--rerun`` names
    it: its results are kept. ``progress`` is given the part's results after each launch (the models not yet
    launched: NOT_RUN); ``launch_seconds`` holds each launch's seconds."""
    seq, context = (512, 128) if args.tiny else (65536, 4096)
    finished = finished_long_context_models(earlier) if earlier else set()
    kept = {
        model: (
            [result for result in earlier["results"] if result["model"] == model],
            earlier["launches"][model],
        )
        for model in finished
    }

    def launch(model: str) -> tuple[list, str]:
        flags = ["--models", model, "--seq_lens", str(seq), "--tokens_per_gpu", str(seq), "--modes",
                 "compiled" if args.device == "cuda" else "eager", "--activations",
                 ",".join(LONG_CONTEXT_ACTIVATIONS), "--data", "real", "--job_flags",
                 f"--training.varlen --training.context_len {context}", "--warmup", "2", "--steps", "5"]  # fmt: skip
        run = throughput_bench(args, work, f"long_context_{model}", flags)
        return run.get("results", []), run.get("error", f"exit status {run.get('status')}")

    def part(values: dict) -> dict:
        return {"results": [result for results, _ in values.values() for result in results],
                "launches": {model: status for model, (_, status) in values.items()}}  # fmt: skip

    return launch_each(MODELS, kept, launch, part, ([], NOT_RUN), progress, args.rerun)


def finished_long_context_models(part: dict) -> set[str]:
    """The models with a result for every activation mode in the long_context part's results ``part``."""
    cases = {
        (result["model"], result["activations"]) for result in part.get("results", []) if not result["error"]
    }
    return {model for model in MODELS if all((model, mode) in cases for mode in LONG_CONTEXT_ACTIVATIONS)}


def model_file(name: str, args, folder: Path) -> Path:
    """The bench model's config as a --model.config file (tiny: the shipped tokenizer's vocabulary)."""
    values = model_config(name, args.tiny)
    if args.tiny:
        values["vocab_size"] = max(values.get("vocab_size", 0), SHIPPED_VOCAB)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(values))
    return path


def log_means(dump: Path, skip_steps: int) -> dict:
    """The mean tokens/s, data share and MFU of the run's log lines after step ``skip_steps``."""
    events = read_scalar_events(dump)
    means = {}
    for key, tag in (("tokens_per_s", "throughput/tokens_per_second_per_device"),
                     ("data_share", "throughput/data_loading_share"), ("mfu", "throughput/mfu_percent")):  # fmt: skip
        values = [value for step, (_, value) in events.get(tag, {}).items() if step > skip_steps]
        means[key] = statistics.fmean(values) if values else float("nan")
    peaks = [
        value for step, (_, value) in events.get("memory/peak_reserved_gib", {}).items() if step > skip_steps
    ]
    means["peak_gib"] = max(peaks, default=float("nan"))
    means["lines"] = len(
        [s for s in events.get("throughput/tokens_per_second_per_device", {}) if s > skip_steps]
    )
    return means


def part_train_sh(args, work: Path, earlier: dict | None = None, progress=None) -> dict:
    return train_sh_launches(args, work / "train_sh", [], earlier, progress)


# The parts whose train.sh launches run the compiled blocks under other CUDA graphs than the default's (inductor's, or
# none), and their flags.
FLAG_PARTS = {
    "train_sh_graphs": ["--compile.mode", "reduce-overhead"],
    "train_sh_no_block_graphs": ["--compile.no-graph_compiled_blocks"],
}


def flag_part(name: str):
    """The runner of one of FLAG_PARTS: train_sh's launches with its flags."""

    def run(args, work: Path, earlier: dict | None = None, progress=None) -> dict:
        if args.device != "cuda":
            return {"error": "CUDA graphs need a CUDA GPU"}
        return train_sh_launches(args, work / name, FLAG_PARTS[name], earlier, progress)

    return run


def train_sh_launches(args, work: Path, extra: list[str], earlier: dict | None, progress) -> dict:
    """One ``bash train.sh`` launch per model with ``extra`` flags: its log's means (log_means) and command. A model
    that ``earlier`` (this part's saved results, under ``--resume``) ran to the end at the same shape is not launched
    again unless ``--rerun`` names it; ``progress`` is given the part's results after each launch (the models not
    yet launched: NOT_RUN)."""
    shape = f"{args.batch_size} x {args.seq_len}"
    finished = {
        name: run
        for name, run in (earlier or {}).get("models", {}).items()
        if earlier["shape"] == shape and isinstance(run, dict) and "error" not in run
    }

    def launch(name: str) -> dict:
        dump = work / name
        flags = ["--model.config", str(model_file(name, args, work / "configs")), "--job.dump_folder", str(dump),
                 "--training.local_batch_size", str(args.batch_size), "--training.seq_len", str(args.seq_len),
                 "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
                 "--checkpoint.no-enable"] + (["--compile.enable"] if args.device == "cuda" else []) + extra  # fmt: skip
        status = run_logged(
            ["bash", "train.sh", *flags], dump.with_suffix(".log"), args.timeout_s, train_env()
        )
        if status != 0:
            return {"error": f"exit status {status}: {last_line(dump.with_suffix('.log'))}"}
        return {**log_means(dump, args.skip_steps), "command": "bash train.sh " + " ".join(flags)}

    def part(rows: dict) -> dict:
        return {"models": rows, "shape": shape}

    return launch_each(MODELS, finished, launch, part, {"error": NOT_RUN}, progress, args.rerun)


def part_torchtitan(args, work: Path) -> dict:
    from torchtitan_anchor import torchtitan_tokens_per_s

    config = model_file("transformer", args, work / "configs")
    return torchtitan_tokens_per_s(
        config, args.batch_size, args.seq_len, steps=args.warmup + args.bench_steps, warmup=args.warmup,
        compile=args.device == "cuda", device=args.device, timeout_s=args.timeout_s, dump_folder=work / "run",
    )  # fmt: skip


def part_first_step(args, work: Path, earlier: dict | None = None, progress=None) -> dict:
    """bench/first_step.py's launches of each model (FIRST_STEP_MODELS), every case. A model whose every case
    ``earlier`` (this part's saved results, under ``--resume``) holds at the same shape is not launched again unless
    ``--rerun`` names it; ``progress`` is given the part's results after each model (those not yet launched:
    NOT_RUN)."""
    shape = f"{args.batch_size} x {args.seq_len}"
    cases = argparse.Namespace(seq_len=args.seq_len, batch_size=args.batch_size, timeout_s=args.timeout_s,
                               tiny=args.tiny, device=args.device, cases=list(FIRST_STEP_CASES))  # fmt: skip
    finished = {
        name: row
        for name, row in (earlier or {}).get("models", {}).items()
        if earlier.get("shape") == shape and set(FIRST_STEP_CASES) <= set(row.get("seconds", {}))
    }

    def launch(name: str) -> dict:
        folder = work / "first_step"
        shutil.rmtree(folder / name, ignore_errors=True)  # a stopped run's launches of this model
        return measure_model(name, cases, folder)

    def part(rows: dict) -> dict:
        return {"models": rows, "shape": shape}

    return launch_each(FIRST_STEP_MODELS, finished, launch, part, {"error": NOT_RUN}, progress, args.rerun)


def part_tokens_to_loss(args, work: Path, earlier: dict | None = None, progress=None) -> dict:
    """AdamW's and Muon's runs; an optimizer whose finished run ``earlier`` (this part's saved results, under
    ``--resume``) holds is not run again unless ``--rerun`` names it. ``progress`` is given the part's results after
    each run (the runs not yet made: NOT_RUN); ``launch_seconds`` holds each run's seconds."""
    import tokens_to_loss

    dataset = REPO / args.t2l_dataset
    if not (dataset / "train.jsonl.gz").exists():
        return {"error": f"no dataset at {args.t2l_dataset}: build it with "
                         f"`python scripts/build_code_corpus.py --out {args.t2l_dataset}`"}  # fmt: skip
    extra = ["--model.config", str(model_file("transformer", args, work / "configs")), "--training.steps",
             str(args.t2l_steps), "--training.local_batch_size", str(args.batch_size), "--training.seq_len",
             str(args.seq_len), "--training.dataset", args.t2l_dataset, "--optimizer.lr", "1e-3",
             "--lr_scheduler.warmup_steps", str(max(1, args.t2l_steps // 12)), "--metrics.log_freq",
             str(args.log_freq)] + (["--compile.enable"] if args.device == "cuda" else [])  # fmt: skip
    t2l = argparse.Namespace(workdir=work / "tokens_to_loss", extra=extra, ngpu=1, val_freq=args.t2l_val_freq,
                             val_steps=args.t2l_val_steps)  # fmt: skip
    runs = {
        optimizer: run for optimizer, run in (earlier or {}).get("runs", {}).items() if isinstance(run, dict)
    }
    command = "bash train.sh " + " ".join(extra)

    def launch(optimizer: str) -> dict | str:
        dump, status = tokens_to_loss.train(optimizer, t2l)
        if status != 0:
            return f"exit status {status}: {last_line(dump.with_suffix('.log'))}"
        run = tokens_to_loss.curve(dump)
        return {**run, "validation": {str(step): value for step, value in run["validation"].items()}}

    def part(values: dict) -> dict:
        return {"runs": values, "command": command}

    return launch_each(OPTIMIZERS, runs, launch, part, NOT_RUN, progress, args.rerun)


# Seconds each part took on one H200 with 16 cores (2026-11-28; first_step then launched two models of its three,
# train_sh_graphs is train_sh's launches): how --gpus spreads the parts.
PART_SECONDS = {"throughput": 148, "train_sh": 175, "train_sh_graphs": 175, "train_sh_no_block_graphs": 175, "torchtitan": 33, "first_step": 574 * 3 // 2,
                "long_context": 515, "tokens_to_loss": 567}  # fmt: skip
# The options a --gpus run passes on to the process of each GPU.
PASSED_ON = ("device", "seq_len", "batch_size", "steps", "skip_steps", "log_freq", "warmup", "bench_steps",
             "timeout_s", "t2l_dataset", "t2l_steps", "t2l_val_freq", "t2l_val_steps")  # fmt: skip


def spread(parts: list[str], gpus: int) -> list[list[str]]:
    """Each GPU's parts (in PARTS order): the longest part first, each to the GPU with the least work so far."""
    shares: list[list[str]] = [[] for _ in range(gpus)]
    load = [0.0] * gpus
    for part in sorted(parts, key=lambda name: -PART_SECONDS[name]):
        gpu = load.index(min(load))
        shares[gpu].append(part)
        load[gpu] += PART_SECONDS[part]
    return [sorted(share, key=PARTS.index) for share in shares if share]


def core_shares(cores: list[int], gpus: int) -> list[list[int]]:
    """Equal, disjoint runs of ``cores``, one per GPU (all of them to each where there are fewer cores than GPUs)."""
    size = len(cores) // gpus
    return [cores[gpu * size : (gpu + 1) * size] if size else cores for gpu in range(gpus)]


def worker_argv(args, parts: list[str], work: Path) -> list[str]:
    """The command-line arguments of the process that runs ``parts`` on one GPU of a --gpus run."""
    argv = ["--parts", ",".join(parts), "--json", str(args.json), "--work", str(work), "--no_write"]
    for name in PASSED_ON:
        argv += [f"--{name}", str(getattr(args, name))]
    argv += ["--rerun", ",".join(args.rerun)] if args.rerun else []
    return argv + (["--tiny"] if args.tiny else []) + (["--resume"] if args.resume else [])


def renamed(part_run: str, worker_run: str, run: str) -> str:
    """A part's runs with ``run`` (a --gpus command) in place of ``worker_run`` (its process' own command), which
    ends them (after the earlier runs whose launches --resume kept)."""
    return part_run.removesuffix(worker_run) + run


def run_on_gpus(args, parts: list[str], work: Path, run: str) -> dict[str, int]:
    """Runs the parts at once on ``args.gpus`` GPUs (see the module's doc); each part's process' exit status. The
    parts' results name ``run`` (this command) as the run that made them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else []
    devices += [str(gpu) for gpu in range(len(devices), args.gpus)]
    shares = spread(parts, args.gpus)
    cores = core_shares(sorted(os.sched_getaffinity(0)), len(shares))
    processes, worker_runs = [], {}
    try:
        for gpu, share in enumerate(shares):
            log = work / f"gpu{gpu}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            print(
                f"GPU {devices[gpu]}: {', '.join(share)} on cores {cores[gpu][0]}-{cores[gpu][-1]} ({log})",
                flush=True,
            )
            argv = worker_argv(args, share, work / f"gpu{gpu}")
            command = [sys.executable, str(REPO / "bench" / "speed.py"), *argv]
            worker_runs.update(dict.fromkeys(share, command_line("bench/speed.py", argv)))
            with open(log, "w") as out:
                process = subprocess.Popen(
                    command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": devices[gpu]},
                    preexec_fn=functools.partial(os.sched_setaffinity, 0, cores[gpu]),
                )  # fmt: skip
            processes.append((share, process))
        statuses = {part: process.wait() for share, process in processes for part in share}
    except BaseException:  # stopped: the parts' processes go with this one
        for _, process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        raise
    if args.json.exists():
        saved = json.loads(args.json.read_text())
        named = {}
        for part in parts:
            if part in saved["parts"]:
                result = saved["parts"][part]
                named[part] = {**result, "run": renamed(result["run"], worker_runs[part], run)}
                if "launch_runs" in result:
                    named[part]["launch_runs"] = {
                        name: {**made, "run": run} if made["run"] == worker_runs[part] else made
                        for name, made in result["launch_runs"].items()
                    }
        save_parts(args.json, named, saved["device"])
    return statuses


RESUMABLE = (
    "first_step",
    "train_sh",
    "train_sh_graphs",
    "train_sh_no_block_graphs",
    "long_context",
    "tokens_to_loss",
)  # the parts whose launches --resume keeps
RUNNERS = {"throughput": part_throughput, "train_sh": part_train_sh, **{name: flag_part(name) for name in FLAG_PARTS},
           "torchtitan": part_torchtitan,
           "first_step": part_first_step, "long_context": part_long_context, "tokens_to_loss": part_tokens_to_loss}  # fmt: skip


def number(value, spec: str, unit: str = "") -> str:
    return "n/a" if value is None or value != value else format(value, spec) + unit


def speedup(before: float, after: float) -> str:
    """How much faster ``after`` seconds are than ``before`` ("1.50x faster", or "1.15x slower")."""
    if before != before or after != after or not before or not after:
        return "n/a"
    return f"{before / after:.2f}x faster" if before >= after else f"{after / before:.2f}x slower"


def bench_result(parts: dict, model: str, mode: str) -> dict | None:
    """The throughput part's result of ``model`` in ``mode`` (the bench's mode, or "naive HF loop")."""
    for result in parts.get("throughput", {}).get("results", []):
        if result["model"] == model and result["mode"] == mode and not result["error"]:
            return result
    return None


def how_far(value: float, target: float) -> str:
    if value != value:
        return "not measured"
    return "yes" if value >= target else f"no: {100 * value / target:.0f}% of it"


def gpu_idle(result: dict | None) -> str:
    """The profiled step's time with no kernel running, from train_throughput's GPU timeline: where it is a large
    share, the host (issuing kernels) and not the kernels bounds the step."""
    timeline = " ".join((result or {}).get("timelines") or [])
    span, idle = (re.search(pattern, timeline) for pattern in (r"([\d.]+) ms from first to last kernel",
                                                                 r"idle ([\d.]+) ms"))  # fmt: skip
    if not (span and idle):
        return ""
    return f"GPU idle {float(idle[1]):.0f} of {float(span[1]):.0f} ms"


def limits(result: dict | None) -> str:
    """What the profiled step says limits a row: its GPU idle time, torch.compile's graph breaks and the top
    kernels."""
    breaks = (result or {}).get("graph_breaks")
    return "; ".join(filter(None, [gpu_idle(result), breaks and f"{breaks} graph breaks",
                                   top_kernels(result) and f"top kernels: {top_kernels(result)}"]))  # fmt: skip


def top_kernels(result: dict | None, count: int = 3) -> str:
    """The profiled step's first ``count`` rows of torch.profiler's table by device time (train_throughput's
    ``profile``), the step's own regions left out: "name self-CUDA-time; ..."."""
    if not result or not result.get("profile"):
        return ""
    rows = []
    for line in result["profile"].splitlines():
        # Name, Self CPU %, Self CPU, CPU total %, CPU total, CPU time avg, Self CUDA, ...: columns 2+ spaces apart.
        fields = re.split(r"\s{2,}", line.strip())
        if len(fields) < 7 or fields[0] == "Name" or fields[0].startswith(("-", "flame.")):
            continue
        rows.append(f"{fields[0]} {fields[6]}")
        if len(rows) == count:
            break
    return "; ".join(rows).replace("|", "/")


def train_sh_rows(parts: dict) -> list[list[str]]:
    """Item 1: train.sh's tokens/s and data share against the bench's on random tokens."""
    out = []
    for model, run in parts["train_sh"]["models"].items():
        if "error" in run:
            out.append(["1", f"{model}: train.sh", run["error"], "", "", "", "no"])
            continue
        bench = bench_result(parts, model, parts["throughput"]["mode"]) if "throughput" in parts else None
        anchor = bench["tokens_per_s"] if bench else float("nan")
        ratio = run["tokens_per_s"] / anchor
        met = ratio >= TARGET_TRAIN_SH_RATIO and run["data_share"] < TARGET_DATA_SHARE
        out.append([
            "1", f"{model}: train.sh tokens/s (data share)",
            f"{number(run['tokens_per_s'], ',.0f')} ({number(100 * run['data_share'], '.2f', '%')})",
            f"bench, random tokens: {number(anchor, ',.0f')}", number(ratio, ".3f"),
            f">= {TARGET_TRAIN_SH_RATIO:.2f}, data < 1%", "yes" if met else "no",
        ])  # fmt: skip
    return out


def case_seconds(row: dict, case: str) -> str:
    """A first-step launch's seconds, or why it gave none (its note: "no step within 110 s", the last line)."""
    value = row["seconds"].get(case, float("nan"))
    return number(value, ".1f") if value == value else row.get("notes", {}).get(case) or "n/a"


def flag_rows(parts: dict, part: str = "train_sh_graphs") -> list[list[str]]:
    """Items 3 and 4 under other CUDA graphs: each model's train.sh launch with the flags of ``part`` (one of
    FLAG_PARTS) beside its default-mode launch (tokens/s, and peak memory: graphs keep their own pool)."""
    graphs, flags = parts[part], " ".join(FLAG_PARTS[part])
    if "error" in graphs:
        return [["3", f"train.sh with {flags}", graphs["error"], "", "", "", "no"]]
    default = parts.get("train_sh", {}).get("models", {})

    def cell(run: dict, mfu: bool) -> str:
        if "error" in run:
            return run["error"]
        tokens = number(run["tokens_per_s"], ",.0f")
        value = f"{number(run['mfu'], '.1f', '%')} ({tokens})" if mfu else tokens
        return f"{value}, {number(run.get('peak_gib'), '.1f')} GiB"

    out = []
    for model in ("gated_deltanet", "hybrid", "transformer"):
        run = graphs["models"].get(model, {"error": "not run"})
        base = default.get(model)
        transformer = model == "transformer"
        anchor = f"default mode: {cell(base, transformer)}" if base else ""
        ratio = (
            number(run["tokens_per_s"] / base["tokens_per_s"], ".2f", "x")
            if base and "error" not in base and "error" not in run
            else ""
        )
        if transformer:
            measured, target = run.get("mfu", float("nan")), TARGET_MFU
            label, target_text = "MFU (tokens/s), peak memory", f">= {TARGET_MFU:.0f}% MFU"
        else:
            measured, target = run.get("tokens_per_s", float("nan")), TARGET_TOKENS_PER_S[model]
            label, target_text = "tokens/s, peak memory", f">= {TARGET_TOKENS_PER_S[model]:,}"
        out.append([
            "4" if transformer else "3",
            f"{model}: train.sh with {flags} {label}, {graphs['shape']}",
            cell(run, transformer), anchor, ratio, target_text, how_far(measured, target),
        ])  # fmt: skip
    return out


def first_step_rows(parts: dict) -> list[list[str]]:
    """Item 2: seconds to the first step on a fresh machine with flame's shipped tuning and train.sh's kernel
    prewarm, beside the same launch without the prewarm and one without either."""
    out = []
    for model, row in parts["first_step"]["models"].items():
        if "error" in row:
            out.append(["2", f"{model}: seconds to the first step", row["error"], "", "", "", "no"])
            continue
        fresh, _, shipped, _ = (row["seconds"].get(case, float("nan")) for case in FIRST_STEP_CASES)
        target = met = ""
        if model == "gated_deltanet":
            target = f"< {TARGET_FIRST_STEP_S:.0f} s"
            met = "not measured" if shipped != shipped else (
                "yes" if shipped < TARGET_FIRST_STEP_S else f"no: {shipped - TARGET_FIRST_STEP_S:.1f} s over")  # fmt: skip
            if shipped == shipped and row.get("phases", {}).get("fresh, shipped tuning"):
                met += f" ({phase_text(row['phases']['fresh, shipped tuning'])})"
        out.append([
            "2", f"{model}: seconds to the first step, fresh machine with flame's shipped tuning (warm)",
            f"{case_seconds(row, FIRST_STEP_CASES[2])} ({case_seconds(row, FIRST_STEP_CASES[3])})",
            f"no kernel prewarm: {case_seconds(row, FIRST_STEP_CASES[1])}; "
            f"fresh, no shipped tuning: {case_seconds(row, FIRST_STEP_CASES[0])}",
            fresh_speedup(row, fresh, shipped), target, met,
        ])  # fmt: skip
    return out


def fresh_speedup(row: dict, fresh: float, shipped: float) -> str:
    """How much faster the shipped tuning's launch was than the fresh one; where the fresh launch gave no step within
    its time limit, at least that limit over the shipped launch's time ("> 3.73x faster")."""
    limit = re.search(r"no step within ([\d.]+) s", row.get("notes", {}).get(FIRST_STEP_CASES[0]) or "")
    if fresh != fresh and shipped == shipped and limit:
        return f"> {float(limit[1]) / shipped:.2f}x faster"
    return speedup(fresh, shipped)


def throughput_rows(parts: dict) -> list[list[str]]:
    """Items 3 and 4: the linear-attention models' tokens/s and the transformer's MFU through train.sh (through the
    bench where train.sh's part did not run), beside the naive HF loop and torchtitan's trainer; what the profiled
    step says limits a row where a target is missed."""
    mode = parts.get("throughput", {}).get("mode", "compiled")
    if "train_sh" in parts:
        source, shape = "train.sh", parts["train_sh"]["shape"]
        runs = parts["train_sh"]["models"]
    else:
        bench = {model: bench_result(parts, model, mode) for model in MODELS}
        source, shape = "bench", next((f"{r['batch']} x {r['seq_len']}" for r in bench.values() if r), "n/a")
        runs = {
            model: {"tokens_per_s": r["tokens_per_s"], "mfu": 100 * r["mfu"]}
            for model, r in bench.items()
            if r
        }
    out = []
    for model in ("gated_deltanet", "hybrid"):
        tokens = runs.get(model, {}).get("tokens_per_s", float("nan"))
        naive = bench_result(parts, model, "naive HF loop")
        anchor = naive["tokens_per_s"] if naive else float("nan")
        met = how_far(tokens, TARGET_TOKENS_PER_S[model])
        if met.startswith("no:") and (limit := limits(bench_result(parts, model, mode))):
            met += f" ({limit})"
        out.append([
            "3", f"{model}: {source} tokens/s, {shape}", number(tokens, ",.0f"),
            f"naive HF loop: {number(anchor, ',.0f')}", number(tokens / anchor, ".2f", "x"),
            f">= {TARGET_TOKENS_PER_S[model]:,}", met,
        ])  # fmt: skip
    run = runs.get("transformer", {})
    mfu, tokens = run.get("mfu", float("nan")), run.get("tokens_per_s", float("nan"))
    titan = parts.get("torchtitan", {})
    naive = bench_result(parts, "transformer", "naive HF loop")
    titan_cell = titan.get("error") or number(titan.get("tokens_per_s"), ",.0f")
    anchors = f"torchtitan's trainer: {titan_cell}; naive HF loop: {number(naive['tokens_per_s'] if naive else None, ',.0f')}"
    ratio = (
        number(tokens / titan["tokens_per_s"], ".2f", "x torchtitan's")
        if titan.get("tokens_per_s")
        else "n/a"
    )
    met = how_far(mfu, TARGET_MFU)
    if met.startswith("no:") and (limit := limits(bench_result(parts, "transformer", mode))):
        met += f" ({limit})"
    out.append([
        "4", f"transformer: {source} MFU (tokens/s), {shape}", f"{number(mfu, '.1f', '%')} ({number(tokens, ',.0f')})",
        anchors, ratio, f">= {TARGET_MFU:.0f}% MFU", met,
    ])  # fmt: skip
    return out + larger_batch_rows(parts, mode)


def larger_batch_rows(parts: dict, mode: str) -> list[list[str]]:
    """Item 4 at twice the micro-batch, in the bench, beside the bench's own row at the usual one."""
    larger = next((r for r in parts.get("throughput", {}).get("larger_batch", {}).get("results", [])
                   if r["model"] == "transformer" and r["mode"] == mode and not r["error"]), None)  # fmt: skip
    if larger is None:
        return []
    usual = bench_result(parts, "transformer", mode)
    usual_tokens = usual["tokens_per_s"] if usual else float("nan")
    usual_shape = f"{usual['batch']} x {usual['seq_len']}" if usual else "the usual batch"
    return [[
        "4", f"transformer: bench MFU (tokens/s), {larger['batch']} x {larger['seq_len']}, peak {number(larger['peak_gib'], '.1f', ' GiB')}",
        f"{number(100 * larger['mfu'], '.1f', '%')} ({number(larger['tokens_per_s'], ',.0f')})",
        f"bench, {usual_shape}: {number(usual_tokens, ',.0f')}", number(larger["tokens_per_s"] / usual_tokens, ".2f", "x"),
        f">= {TARGET_MFU:.0f}% MFU", how_far(100 * larger["mfu"], TARGET_MFU),
    ]]  # fmt: skip


def launch_outcome(long_context: dict, model: str) -> str:
    """How the launch that measured ``model``'s long-context cases ended (a run saved before one launch per model
    kept one exit status for all)."""
    outcome = (
        long_context["launches"][model]
        if "launches" in long_context
        else f"exit status {long_context['status']}"
    )
    if outcome.startswith("exit status 124"):  # run_logged's status for a launch it stopped at --timeout_s
        last = outcome.removeprefix("exit status 124").removeprefix(": ")
        return "its launch reached the time limit, --timeout_s" + (f"; its last line: {last}" if last else "")
    if match := re.match(r"exit status -(\d+)$", outcome):  # Popen's status of a process a signal ended
        number = int(match[1])
        name = signal.Signals(number).name if number in signal.valid_signals() else "a signal"
        return f"its launch was killed by {name} (signal {number})"
    return outcome


def long_context_rows(parts: dict) -> list[list[str]]:
    """Item 5: the 64k-token varlen job of each model in each activation mode; offloading beside full activation
    checkpointing of the same launch (what it costs in tokens/s and saves in memory)."""
    long_context = parts["long_context"]
    if "error" in long_context:
        return [["5", "64k-token varlen job", long_context["error"], "", "", "trains", "no"]]
    results = {(result["model"], result["activations"]): result for result in long_context["results"]}
    seq_len = next((result["seq_len"] for result in results.values()), 65536)

    def measured(result: dict) -> str:
        host = (
            f" + {number(result['host_gib'], '.1f')} GiB of host memory"
            if result.get("host_gib") is not None
            else ""
        )
        return result["error"] or (
            f"{number(result['tokens_per_s'], ',.0f')} tokens/s, {number(result['peak_gib'], '.1f')} GiB{host}")  # fmt: skip

    out = []
    for model in MODELS:
        for activations in LONG_CONTEXT_ACTIVATIONS:
            result = results.get((model, activations))
            anchor, ratio = "", ""
            if result is None:  # the model's launch ended before this case (its time limit, a crash)
                text = (
                    f"no result: the bench stopped before this case ({launch_outcome(long_context, model)})"
                )
            else:
                text = measured(result)
                full = results.get((model, "full"))
                if activations != "full" and full is not None and not full["error"] and not result["error"]:
                    anchor = f"full checkpointing: {measured(full)}"
                    ratio = (f"{number(result['tokens_per_s'] / full['tokens_per_s'], '.2f', 'x the tokens/s')}, "
                             f"{number(result['peak_gib'] - full['peak_gib'], '+.1f', ' GiB')}")  # fmt: skip
            out.append([
                "5", f"{model}: batch 1 x {seq_len}, {activations} activations", text, anchor, ratio, "trains",
                "yes" if result and not result["error"] else "no",
            ])  # fmt: skip
    return out


def tokens_to_loss_rows(parts: dict) -> list[list[str]]:
    """Item 6: Muon's tokens and seconds to the loss both runs reach, beside AdamW's."""
    t2l = parts["tokens_to_loss"]
    if "error" in t2l:
        return [["6", "tokens to a validation loss", t2l["error"], "", "", "", "no"]]
    for name, run in t2l["runs"].items():
        if not isinstance(run, dict):
            return [["6", f"tokens to a validation loss: {name}", run, "", "", "", "no"]]
    runs = t2l["runs"]
    target = max(run["validation"][max(run["validation"], key=int)][1] for run in runs.values())

    def first_at_target(run: dict) -> tuple[float, float]:
        for step, (seconds, loss) in sorted(run["validation"].items(), key=lambda item: int(item[0])):
            if loss <= target:
                return int(step) * run["tokens_per_step"], seconds
        return float("nan"), float("nan")

    (adam_tokens, adam_s), (muon_tokens, muon_s) = (
        first_at_target(runs["AdamW"]),
        first_at_target(runs["Muon"]),
    )
    return [[
        "6", f"Muon: tokens (seconds) to validation loss {target:.3f}, the higher of the two runs' last",
        f"{number(muon_tokens, ',.0f')} ({number(muon_s, '.1f')} s)",
        f"AdamW: {number(adam_tokens, ',.0f')} ({number(adam_s, '.1f')} s)",
        number(muon_tokens / adam_tokens, ".2f", "x the tokens"), "", "measured",
    ]]  # fmt: skip


def rows(parts: dict) -> list[list[str]]:
    """The table's rows (item, measurement, measured, anchor, ratio, target, met) of the parts measured."""
    out = []
    if "train_sh" in parts:
        out += train_sh_rows(parts)
    if "first_step" in parts:
        out += first_step_rows(parts)
    if "train_sh" in parts or "throughput" in parts:
        out += throughput_rows(parts)
    for part in FLAG_PARTS:
        if part in parts:
            out += flag_rows(parts, part)
    if "long_context" in parts:
        out += long_context_rows(parts)
    if "tokens_to_loss" in parts:
        out += tokens_to_loss_rows(parts)
    return out


TABLE_HEAD = ["| item | measurement | measured | anchor, same run | ratio | target | met |",
              "|---|---|---|---|---:|---|---|"]  # fmt: skip


def row_lines(parts: dict) -> list[str]:
    return ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows(parts)]


def table(lines: list[str]) -> str:
    return "\n".join(TABLE_HEAD + lines)


# Which of the issue's items a part's results give rows to (item 1 needs train_sh and throughput both).
PART_ITEMS = {"throughput": {1, 3, 4}, "train_sh": {1, 3, 4}, "train_sh_graphs": {3, 4}, "train_sh_no_block_graphs": {3, 4}, "torchtitan": {4}, "first_step": {2},
              "long_context": {5}, "tokens_to_loss": {6}}  # fmt: skip
ROW_ITEM = re.compile(r"^\| (\d+) \|")
RUN_LINE = re.compile(r"^- (`.*`) \(items? ([\d, ]+); (.*)\)$")


def items_text(items: set[int]) -> str:
    return ("items " if len(items) > 1 else "item ") + ", ".join(map(str, sorted(items)))


def run_lines(saved: dict, items_shown: set[int]) -> list[str]:
    """One line per run of the saved parts: its command, the items its rows are, the dates its parts ran, torch and
    each part's seconds."""
    parts = saved["parts"]
    out = []
    for run, dates in runs_and_dates(parts, saved["date"]).items():
        run_parts = [part for part in PARTS if part in parts and parts[part]["run"] == run]
        items = set().union(*(PART_ITEMS[part] for part in run_parts)) & items_shown
        if not items:
            continue
        seconds = ", ".join(f"{part} {parts[part]['seconds']:.0f} s" for part in run_parts)
        out.append(f"- `{run}` ({items_text(items)}; {dates}; torch {saved['torch']}; {seconds})")
    return out


def merged_with_section(
    old_section: str, new_runs: list[str], new_rows: list[str]
) -> tuple[list[str], list[str]]:
    """The runs and rows of a device's section after this run: the rows of the items it measured, and the earlier
    section's rows of every other item with the runs that measured them (so that parts measured on different days,
    or by a run cut short, make one table). Rows come in the items' order, runs in the order of their first items."""
    new_items = {int(ROW_ITEM.match(row)[1]) for row in new_rows}
    kept_rows = [line for line in old_section.splitlines()
                 if (match := ROW_ITEM.match(line)) and int(match[1]) not in new_items]  # fmt: skip
    kept_items = {int(ROW_ITEM.match(row)[1]) for row in kept_rows}
    kept_runs = []
    for line in old_section.splitlines():
        if match := RUN_LINE.match(line):
            items = {int(item) for item in match[2].split(",")} & kept_items
            if items:
                kept_runs.append(f"- {match[1]} ({items_text(items)}; {match[3]})")
    rows_in_order = sorted(kept_rows + new_rows, key=lambda row: int(ROW_ITEM.match(row)[1]))
    runs_in_order = sorted(
        kept_runs + new_runs, key=lambda run: min(map(int, RUN_LINE.match(run)[2].split(",")))
    )
    return runs_in_order, rows_in_order


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma separated: " + ", ".join(PARTS) + " (empty: the table of the parts --json holds)",
    )
    parser.add_argument("--json", type=Path, required=True, help="every part's results, kept between runs")
    parser.add_argument(
        "--work", type=Path, default=None, help="logs and dumps (default: a temporary folder)"
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models and shapes (smoke test)")
    parser.add_argument("--seq_len", type=int, default=None, help="default 2048 (--tiny: 64)")
    parser.add_argument("--batch_size", type=int, default=None, help="default 8 (--tiny: 2)")
    parser.add_argument("--steps", type=int, default=None, help="train.sh steps (default 60; --tiny: 6)")
    parser.add_argument(
        "--skip_steps", type=int, default=None, help="log lines up to this step left out (20; 2)"
    )
    parser.add_argument("--log_freq", type=int, default=None, help="train.sh's metrics.log_freq (10; 1)")
    parser.add_argument("--warmup", type=int, default=3, help="the benches' untimed steps")
    parser.add_argument("--bench_steps", type=int, default=10, help="the benches' timed steps")
    parser.add_argument("--timeout_s", type=float, default=900, help="per launch")
    parser.add_argument("--t2l_dataset", default="exp/code_corpus", help="tokens_to_loss: the dataset folder")
    parser.add_argument("--t2l_steps", type=int, default=1200)
    parser.add_argument("--t2l_val_freq", type=int, default=100)
    parser.add_argument("--t2l_val_steps", type=int, default=20)
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="run the parts at once on this many GPUs of this machine, each GPU's in a process of its own with an "
        "equal share of the CPU cores",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep what --json's earlier runs finished: first_step, train_sh, train_sh_graphs, "
        "train_sh_no_block_graphs, long_context, "
        "tokens_to_loss run only the launches (a model's, an optimizer's) not finished; the other parts, saved whole, "
        "are not run again where saved without an error",
    )
    parser.add_argument(
        "--rerun",
        default="",
        help="comma separated models (first_step, train_sh, the graph parts, long_context) or optimizers "
        "(tokens_to_loss): --resume, launching these again though an earlier run finished them",
    )
    add_doc_options(parser)
    parser.add_argument("--write_doc", action="store_true", help="write the doc on a CPU too")
    args = parser.parse_args(argv)
    if unknown := set(filter(None, args.parts.split(","))) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    args.rerun = list(filter(None, args.rerun.split(",")))
    if unknown := set(args.rerun) - set(MODELS) - set(OPTIMIZERS):
        parser.error(f"--rerun {','.join(sorted(unknown))}: name models ({', '.join(MODELS)}) or optimizers "
                     f"({', '.join(OPTIMIZERS)})")  # fmt: skip
    args.resume = args.resume or bool(args.rerun)
    if args.gpus < 1 or (args.device == "cuda" and args.gpus > torch.cuda.device_count()):
        parser.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} visible GPU(s)")
    if not args.parts.strip(",") and not args.json.exists():
        parser.error(f"--parts is empty and {args.json} holds no results: name the parts to run")
    defaults = {"seq_len": (2048, 64), "batch_size": (8, 2), "steps": (60, 6), "skip_steps": (20, 2),
                "log_freq": (10, 1)}  # fmt: skip
    for name, (full, tiny) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    return args


def runs_and_dates(parts: dict, saved_date: str) -> dict[str, str]:
    """Each run of the parts saved, in the parts' order, with the dates its parts ran (a file can hold parts of
    runs on different days; parts saved without a date ran on the file's date)."""
    dates: dict[str, list[str]] = {}
    for part in PARTS:
        if part in parts:
            run_dates = dates.setdefault(parts[part]["run"], [])
            for date in parts[part].get("date", saved_date).split(", "):
                if date not in run_dates:
                    run_dates.append(date)
    return {run: ", ".join(run_dates) for run, run_dates in dates.items()}


def named_part(
    result: dict,
    argv: list[str] | None,
    started: float,
    earlier: dict | None = None,
    began: float | None = None,
) -> dict:
    """A part's results with this run's command, date and seconds since ``started``. A resumable part's launches
    each keep the run that made them (``launch_runs``: its command, date, start ``began``, epoch seconds, and the
    launch's seconds): this run's launches name it, the launches kept from ``earlier`` (--resume) their own runs,
    and the part is named by its launches' runs, earliest first, with their dates and seconds."""
    this = {"run": command_line("bench/speed.py", argv), "date": time.strftime("%Y-%m-%d")}
    if "launch_seconds" not in result:
        return {**result, **this, "seconds": time.perf_counter() - started}
    launch_runs = {name: earlier["launch_runs"][name] for name in result["kept"]}
    for name, seconds in result["launch_seconds"].items():
        launch_runs[name] = {**this, "began": time.time() if began is None else began, "seconds": seconds}
    in_order = sorted(launch_runs.values(), key=lambda made: made["began"])
    runs = list(dict.fromkeys(made["run"] for made in in_order))
    dates = list(dict.fromkeys(date for made in in_order for date in made["date"].split(", ")))
    seconds = sum(made["seconds"] for made in in_order)
    return {**result, "launch_runs": launch_runs, "run": "; ".join(runs), "date": ", ".join(dates),
            "seconds": seconds}  # fmt: skip


def save_named(path: Path, part: str, device: str, named, result: dict) -> None:
    """save_parts of one part's results so far, ``named`` (named_part) for the run that is making them."""
    save_parts(path, {part: named(result)}, device)


def saved_part(path: Path, part: str) -> dict | None:
    """``part``'s results in the --json file ``path``, or None."""
    return json.loads(path.read_text())["parts"].get(part) if path.exists() else None


def save_parts(path: Path, measured: dict, device: str) -> None:
    """Writes this run's parts into ``path`` over the parts it holds, read again just before: runs of other parts on
    the other GPUs of a machine can share one file. It names this process' device, torch and date."""
    with open(path, "a+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        file.seek(0)
        text = file.read()
        parts = {**(json.loads(text)["parts"] if text else {}), **measured}
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                               "parts": parts}, indent=1))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop_on_sigterm()
    measured = {}
    with tempfile.TemporaryDirectory(prefix="flame-speed-") as scratch:
        work = args.work or Path(scratch)
        parts_to_run = list(filter(None, args.parts.split(",")))
        if args.resume:  # a part saved only whole, and saved without an error, is finished
            for part in [part for part in parts_to_run if part not in RESUMABLE]:
                earlier_part = saved_part(args.json, part)
                if earlier_part is not None and "error" not in earlier_part:
                    print(f"{part}: kept from `{earlier_part['run']}` (--resume keeps a finished part; leave "
                          "--resume out to measure it again)", flush=True)  # fmt: skip
                    parts_to_run.remove(part)
        failed = False
        if args.gpus > 1 and parts_to_run:
            statuses = run_on_gpus(args, parts_to_run, work, command_line("bench/speed.py", argv))
            for part, status in statuses.items():
                print(f"{part}: its process ended with exit status {status}", flush=True)
            failed = any(statuses.values())
            parts_to_run = []
            if not args.json.exists():
                print(f"no part saved a result in {args.json}; each GPU's log is in {work}", file=sys.stderr)
                return 1
        device = device_name(torch.device(args.device))
        for part in parts_to_run:
            named = functools.partial(named_part, argv=argv, started=time.perf_counter(), began=time.time())
            if part in RESUMABLE:  # its launches are saved as they finish, and --resume keeps them
                earlier = saved_part(args.json, part) if args.resume else None
                if earlier is not None and "launch_runs" not in earlier:
                    print(
                        f"{part}: its saved results name no run per launch; launching all of it", flush=True
                    )
                    earlier = None
                named = functools.partial(named, earlier=earlier)
                progress = functools.partial(save_named, args.json, part, device, named)
                measured[part] = named(RUNNERS[part](args, work / part, earlier, progress))
            else:
                measured[part] = named(RUNNERS[part](args, work / part))
            print(f"{part}: {measured[part]['seconds']:.0f} s", flush=True)
            save_parts(args.json, measured, device)
    saved = json.loads(args.json.read_text())
    parts = saved["parts"]
    new_rows = row_lines(parts)
    print("\n" + table(new_rows))
    if not args.no_write and (args.device == "cuda" or args.write_doc):
        marker = f"{MARKER}_{device_slug(saved['device'])}"
        new_runs = run_lines(saved, {int(ROW_ITEM.match(row)[1]) for row in new_rows})
        doc_text = args.doc.read_text() if args.doc.exists() else ""
        runs, all_rows = merged_with_section(section_in(doc_text, marker), new_runs, new_rows)
        write_section(
            args.doc,
            marker,
            f"The speed table, {saved['device']}",
            f"Measured on {saved['device']} by these runs (the items of their rows; the dates their parts ran; torch; "
            "each part's seconds):\n\n"
            + "\n".join(runs)
            + "\n\nItems of the speed issue: 1 train.sh against the "
            "bench, 2 the first step, 3 the linear-attention models' throughput, 4 the transformer's MFU (3 and 4 "
            "through train.sh, or the bench where train.sh's part did not run), 5 long context, 6 tokens to a loss. "
            "Each anchor ran in the same run (bench/speed.py says how each part runs). A run replaces the rows of the "
            "items it measured and keeps the others with the runs that measured them.",
            table(all_rows),
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
