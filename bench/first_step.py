"""Time from `bash train.sh` to the end of its first step, for each bench model, on a fresh machine and a warm one.

    python bench/first_step.py                                   # every bench model, one GPU
    python bench/first_step.py --models gated_deltanet,transformer
    python bench/first_step.py --models gated_deltanet --cases shipped,warm     # without the ~220-s fresh launch
    python bench/first_step.py --device cpu --tiny --models transformer --no_write   # smoke test

A fresh machine is imitated with empty cache folders: each case launches train.sh with its own Triton cache
(``TRITON_CACHE_DIR``: compiled kernels and autotuning results), inductor cache (``TORCHINDUCTOR_CACHE_DIR``) and
TileLang cache (``TILELANG_CACHE_DIR``: the kernels FLA's TileLang backend and FlashQLA compile with nvcc), so
nothing an earlier run compiled or tuned is found. Per model, four launches, one after the other:

1. fresh: empty caches and ``FLAME_SHIPPED_TUNING=0``: every kernel is compiled and FLA's are benchmarked, as on a
   machine without flame's tuning results for its GPU;
2. fresh, shipped tuning, no prewarm: empty caches, flame's tuning results for the GPU written into the Triton
   cache at launch (flame/assets/autotune; the log's "wrote N" line gives N, 0 where flame has none for this GPU),
   and ``FLAME_PREWARM=0``: the ranks compile every kernel themselves, inside the first step;
3. fresh, shipped tuning: the same with train.sh's kernel prewarm (flame/train/prewarm.py), as a user launches;
4. warm: launch 3's caches, now filled: a restart on the same machine.

``--cases`` picks some of them (fresh, noprewarm, shipped, warm; warm needs shipped).

Each launch is ``NGPU=1 bash train.sh`` with the model's config, ``--training.steps 1``, 8 x 2048 tokens (the bench's
default), ``--compile.enable`` on a GPU, no checkpoint, the shipped corpus; the time runs from the launch to the
``step 1/1`` log line (the process's start, imports, model build, compilation, tuning and the step itself), and a
launch gets ``--timeout_s``. The table splits each launch's time at the first line of each phase (``PHASES``): start
(to the rank's first log line: the pre-flight, the launcher, imports), setup (to "Training starts": model build,
parallelize, data) and step 1 (compilation, Triton's compiling and tuning, the step). A launch's notes count the
kernels its rank and its prewarm tuned, and their seconds (flame.ops.autotune's log lines): none where the shipped
tuning holds every kernel, shape and kernel source the model calls; below each launch's line the bench prints those
log lines whole, with the key each kernel tuned at. Prints the table and, on a GPU, writes it into
docs/performance.md between ``<!-- bench_first_step -->`` markers with the command, device and date.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from families import stop_on_sigterm, train_env  # noqa: E402
from train_throughput import MODELS, add_doc_options, command_line, device_name, model_config, write_section  # noqa: E402

MARKER = "bench_first_step"
FIRST_STEP = re.compile(r"\bstep\s+1/\d+\b")
# Where a launch's time goes: each phase ends at the first line that matches its pattern.
PHASES = (
    ("start", re.compile(r"^\[rank0\]:")),  # the pre-flight, the launcher and the rank's imports
    ("setup", re.compile(r"Training starts at step")),  # mesh, model build, parallelize, checkpoint, data
    ("step 1", FIRST_STEP),  # compilation, Triton's compiling and autotuning, CUDA graph capture, the step
)
SHIPPED = re.compile(r"wrote (\d+) of flame's tuning results")
# flame.ops.autotune's line for each kernel a process tuned
TUNED = re.compile(r"tuned Triton kernel (\S+) over \d+ settings in ([\d.]+) s")
CASES = ("fresh", "fresh, shipped tuning, no prewarm", "fresh, shipped tuning", "warm")
CASE_NAMES = dict(zip(("fresh", "noprewarm", "shipped", "warm"), CASES))  # --cases' names
SHIPPED_VOCAB = 4096  # the default job's tokenizer (flame/assets/tokenizer)


def launch_command(config: Path, dump: Path, args) -> list[str]:
    flags = ["--model.config", str(config), "--job.dump_folder", str(dump), "--training.steps", "1",
             "--training.seq_len", str(args.seq_len), "--training.batch_size", str(args.batch_size),
             "--checkpoint.no-enable", "--metrics.log_freq", "1"]  # fmt: skip
    if args.device == "cuda":
        flags.append("--compile.enable")
    return ["bash", str(REPO / "train.sh"), *flags]


# The compilers' caches a launch fills, each in its own folder of the case's caches.
CACHE_VARIABLES = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TILELANG_CACHE_DIR": "tilelang",
}


def case_env(caches: Path, shipped: bool, prewarm: bool = True) -> dict[str, str]:
    folders = {variable: str(caches / name) for variable, name in CACHE_VARIABLES.items()}
    flags = {"FLAME_SHIPPED_TUNING": "1" if shipped else "0", "FLAME_PREWARM": "1" if prewarm else "0"}
    return {**train_env(), **folders, **flags}


def time_to_first_step(
    command: list[str], env: dict[str, str], log: Path, timeout_s: float
) -> tuple[float, str, dict[str, float]]:
    """(seconds from the launch to the first step's log line, or NaN; what the row needs from the launch: the
    shipped results written and the kernels the ranks tuned (flame.ops.autotune logs each), or why no step came;
    the seconds of each of ``PHASES`` the launch finished). The launch runs to its end; at ``timeout_s`` its whole
    process group is killed."""
    started = time.perf_counter()
    first = float("nan")
    ends: dict[str, float] = {}
    lines = []
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env={**os.environ, **env}, start_new_session=True)  # fmt: skip
    timer = threading.Timer(timeout_s, os.killpg, (process.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in process.stdout:  # train.sh prints the ranks' log lines as they come
            lines.append(line)
            for name, pattern in PHASES:
                if name not in ends and pattern.search(line):
                    ends[name] = time.perf_counter() - started
            if first != first and FIRST_STEP.search(line):
                first = ends["step 1"]
        status = process.wait()
    except BaseException:  # stopped: the launch goes with this process
        os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        timer.cancel()
    timed_out = time.perf_counter() - started >= timeout_s
    log.write_text("".join(lines))
    shipped = [int(m[1]) for line in lines if (m := SHIPPED.search(line))]
    if first == first:
        shipped_note = f"shipped results written: {shipped[0]}" if shipped else ""
        note = "; ".join(filter(None, [shipped_note, tuning_note(lines, "the ranks")]))
    elif timed_out:
        note = f"no step within {timeout_s:.0f} s"
    else:
        note = next((line.strip() for line in reversed(lines) if line.strip()), f"exit status {status}")
    phases, previous = {}, 0.0
    for name, _ in PHASES:
        if name not in ends:
            break
        phases[name], previous = ends[name] - previous, ends[name]
    return first, note, phases


def measure_model(name: str, args, work: Path) -> dict:
    """The model's launches; its row as a dict."""
    folder = work / name
    folder.mkdir(parents=True)
    config = folder / "config.json"
    values = model_config(name, args.tiny)
    values["vocab_size"] = max(values.get("vocab_size", 0), SHIPPED_VOCAB)  # the tiny models' 256 is too few
    config.write_text(json.dumps(values))
    row = {"model": name, "seconds": {}, "notes": {}, "phases": {}}
    fresh, no_prewarm, shipped = (folder / f"caches-{name}" for name in ("fresh", "no-prewarm", "shipped"))
    launches = (
        (CASES[0], fresh, False, True),
        (CASES[1], no_prewarm, True, False),
        (CASES[2], shipped, True, True),
        (CASES[3], shipped, True, True),
    )
    for case, caches, shipped_tuning, prewarm in (launch for launch in launches if launch[0] in args.cases):
        dump = folder / f"dump-{len(row['seconds'])}"
        seconds, note, phases = time_to_first_step(
            launch_command(config, dump, args),
            case_env(caches, shipped_tuning, prewarm),
            folder / f"{case}.log",
            args.timeout_s,
        )
        note = "; ".join(filter(None, [note, prewarm_tuning(dump)]))
        row["seconds"][case], row["notes"][case], row["phases"][case] = seconds, note, phases
        print(f"{name}, {case}: {seconds:.1f} s ({phase_text(phases)}) {note}".rstrip(), flush=True)
        log = folder / f"{case}.log"
        for line in tuning_lines(log.read_text().splitlines() if log.exists() else [], prewarm_lines(dump)):
            print(f"  {line}", flush=True)
    return row


def tuning_note(lines: list[str], tuner: str) -> str:
    """'kernels tuned by <tuner>: N (S s: name, name x2)' from flame.ops.autotune's lines among ``lines`` (a kernel
    tuned at several keys counted once per key); '' where none."""
    tuned = [(m[1], float(m[2])) for line in lines if (m := TUNED.search(line))]
    if not tuned:
        return ""
    counts = Counter(name for name, _ in tuned)
    names = ", ".join(name if count == 1 else f"{name} x{count}" for name, count in sorted(counts.items()))
    return f"kernels tuned by {tuner}: {len(tuned)} ({sum(seconds for _, seconds in tuned):.1f} s: {names})"


def prewarm_lines(dump: Path) -> list[str]:
    """The launch's prewarm log (train.sh's <dump_folder>/logs/prewarm.log), [] where it ran none."""
    log = dump / "logs" / "prewarm.log"
    return log.read_text().splitlines() if log.exists() else []


def prewarm_tuning(dump: Path) -> str:
    """The kernels the launch's prewarm tuned, from its log."""
    return tuning_note(prewarm_lines(dump), "the prewarm")


def tuning_lines(*logs: list[str]) -> list[str]:
    """flame.ops.autotune's line for each kernel the logs' processes tuned, whole: it names the tuning key, which
    says why a shipped result did not serve the call (the table's notes count the kernels only)."""
    return [line.strip() for lines in logs for line in lines if TUNED.search(line)]


def phase_text(phases: dict[str, float]) -> str:
    """'start 9.1 + setup 3.2 + step 1 55.9 s': the phases a launch finished."""
    return (
        " + ".join(f"{name} {seconds:.1f}" for name, seconds in phases.items()) + " s"
        if phases
        else "no phase"
    )


def table(rows: list[dict]) -> str:
    """One row per model, one column per case its launches ran."""
    cases = [case for case in CASES if any(case in row["seconds"] for row in rows)]
    lines = ["| model | " + " | ".join(f"{case} s" for case in cases) + " | where the time went | notes |",
             "|---|" + "---:|" * len(cases) + "---|---|"]  # fmt: skip
    for row in rows:
        seconds = [row["seconds"].get(c, float("nan")) for c in cases]
        cells = [f"{s:.1f}" if s == s else "no step" for s in seconds]
        notes = "; ".join(f"{c}: {row['notes'][c]}" for c in cases if row["notes"].get(c)).replace("|", "\\|")
        phases = "; ".join(
            f"{c}: {phase_text(row['phases'][c])}" for c in cases if c in row.get("phases", {})
        )
        lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {phases} | {notes} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma separated: " + ", ".join(MODELS))
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--timeout_s", type=float, default=600, help="per launch")
    parser.add_argument(
        "--cases",
        default=",".join(CASE_NAMES),
        help="comma separated launches per model: fresh, noprewarm (fresh caches, flame's tuning results, no kernel "
        "prewarm), shipped (the same with the prewarm), warm (shipped's caches again; needs shipped)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny versions of the models (smoke test)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    add_doc_options(parser)
    args = parser.parse_args(argv)
    if unknown := set(args.models.split(",")) - set(MODELS):
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASE_NAMES):
        parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASE_NAMES)}")
    if "warm" in cases and "shipped" not in cases:
        parser.error("--cases warm relaunches the shipped case's caches: add shipped")
    args.cases = [CASE_NAMES[name] for name in CASE_NAMES if name in cases]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop_on_sigterm()  # unwinds through time_to_first_step, which kills the launch
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="flame-first-step-") as work:
        for name in args.models.split(","):
            rows.append(measure_model(name, args, Path(work)))
    text = table(rows)
    print("\n" + text)
    if not args.no_write and args.device == "cuda":
        command = command_line("bench/first_step.py", argv)
        write_section(
            args.doc,
            MARKER,
            "Time to the first step",
            f"Command: `{command}` on {device_name(torch.device(args.device))}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f} s). Seconds from `bash train.sh` "
            "to its `step 1/1` line, 8 x 2048 tokens, compiled, in a new process per launch: fresh (empty Triton, "
            "inductor and TileLang caches, flame's shipped tuning off), fresh with flame's shipped tuning results "
            "for the GPU without and with train.sh's kernel prewarm, and warm (the last launch's caches again).",
            text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
