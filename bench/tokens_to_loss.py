"""Tokens and seconds to a validation loss for each optimizer: the same job through train.sh, one run per optimizer.

    python bench/tokens_to_loss.py --ngpu 1 -- --model.config configs/transformer_340M.json --training.steps 3000 \\
        --training.batch_size 8 --training.seq_len 2048 --compile.enable
    python bench/tokens_to_loss.py --ngpu 1 --val_freq 2 --val_steps 2 -- --training.steps 6   # the default CPU job

Each optimizer's run is ``bash train.sh`` with the flags after ``--``, then ``--optimizer.name <optimizer>``,
validation every ``--val_freq`` steps and at the last one (``--val_steps`` batches of the dataset's validation
split, the same tokens every time) and checkpoints off, in ``--workdir``/<optimizer>, one run after the other on
the same devices. The runs' TensorBoard events give each validation's loss and wall time and the tokens trained
(``tokens_seen``, all ranks).

The target is the highest of the runs' last validation losses: the loss every run reaches. For each run the table
gives the first validation at or below it: its step, the tokens trained by then, and the seconds from the first
step's log to it (each optimizer's step costs its own time, so the seconds say which one gets there sooner); and the
run's last validation loss. Prints the table and writes it into docs/performance.md between
``<!-- bench_tokens_to_loss -->`` markers with the command, device and date. Exit status 0 when every run finished.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from train_throughput import add_doc_options, command_line, device_name, write_section  # noqa: E402

from flame.plot import PlotError, read_scalar_events  # noqa: E402

MARKER = "bench_tokens_to_loss"


def train(optimizer: str, args: argparse.Namespace) -> tuple[Path, int]:
    """One run of the job with ``optimizer``: its dump folder and exit status (its output in <dump>.log)."""
    dump = args.workdir / optimizer
    flags = ["--job.dump_folder", str(dump), *args.extra, "--optimizer.name", optimizer, "--validation.enable",
             "--validation.freq", str(args.val_freq), "--validation.steps", str(args.val_steps),
             "--checkpoint.no-enable"]  # fmt: skip
    env = dict(os.environ, NGPU=str(args.ngpu), FLAME_EXPORT_HF="0")
    print(f"== {optimizer}: NGPU={args.ngpu} bash train.sh {shlex.join(flags)}", flush=True)
    dump.parent.mkdir(parents=True, exist_ok=True)
    with open(dump.with_suffix(".log"), "w") as log:
        status = subprocess.run(["bash", str(REPO / "train.sh"), *flags], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT).returncode  # fmt: skip
    return dump, status


def curve(dump: Path) -> dict:
    """The run's validations {step: (seconds since the first step's log, loss)} and tokens trained per step."""
    events = read_scalar_events(dump)
    validation, train_loss, seen = events["loss/validation"], events["loss/train"], events["tokens_seen"]
    first_log = train_loss[min(train_loss)][0]
    last = max(seen)
    return {
        "validation": {step: (wall - first_log, loss) for step, (wall, loss) in sorted(validation.items())},
        "tokens_per_step": seen[last][1] / last,
    }


def reached(run: dict, target: float) -> tuple[int, float, float] | None:
    """The first validation at or below ``target``: (step, tokens, seconds)."""
    for step, (seconds, loss) in run["validation"].items():
        if loss <= target:
            return step, step * run["tokens_per_step"], seconds
    return None


def table(runs: dict[str, dict | str]) -> tuple[str, float | None]:
    """The markdown table of the runs (a run that failed is a string: why) and the target loss."""
    finished = {name: run for name, run in runs.items() if isinstance(run, dict)}
    last = {name: run["validation"][max(run["validation"])][1] for name, run in finished.items()}
    target = max(last.values()) if last else None
    lines = [
        "| optimizer | last validation loss | step at the target | tokens to the target | seconds to the target | "
        "tokens against the first row's |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    baseline = None
    for name, run in runs.items():
        if isinstance(run, str):
            lines.append(f"| {name} | failed: {run} | | | | |")
            continue
        step, tokens, seconds = reached(run, target)
        baseline = baseline or tokens
        lines.append(
            f"| {name} | {last[name]:.4f} | {step} | {tokens:,.0f} | {seconds:.1f} | {tokens / baseline:.2f} |"
        )
    return "\n".join(lines), target


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ngpu", type=int, default=1, help="NGPU for every run")
    parser.add_argument("--optimizers", default="AdamW,Muon", help="comma separated optimizer.name values")
    parser.add_argument("--val_freq", type=int, default=100, help="validate every this many steps")
    parser.add_argument("--val_steps", type=int, default=20, help="validation batches per validation")
    parser.add_argument("--workdir", type=Path, default=REPO / "exp" / "tokens_to_loss")
    add_doc_options(parser)
    parser.add_argument("extra", nargs="*", help="the job's train.sh flags (after --)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    runs: dict[str, dict | str] = {}
    for optimizer in args.optimizers.split(","):
        dump, status = train(optimizer, args)
        try:
            runs[optimizer] = (
                curve(dump) if status == 0 else f"exit status {status}; see {dump.with_suffix('.log')}"
            )
        except (PlotError, KeyError) as error:  # no events, or no validation in them
            runs[optimizer] = f"no validation losses in its events ({error}); see {dump.with_suffix('.log')}"
    text, target = table(runs)
    if target is not None:
        text += f"\n\nTarget: validation loss {target:.4f}, the highest of the runs' last."
    print("\n" + text)
    if not args.no_write:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        job = shlex.join(args.extra)
        command = command_line("bench/tokens_to_loss.py", argv)
        write_section(
            args.doc,
            MARKER,
            "Tokens to a validation loss, per optimizer",
            f"Command: `{command}` on {args.ngpu} x {device_name(device)}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}); the job `NGPU={args.ngpu} bash train.sh {job}` once per optimizer, "
            f"validation every {args.val_freq} steps on {args.val_steps} batches of the validation split. Seconds "
            f"count from the first step's log. Total {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0 if all(isinstance(run, dict) for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
