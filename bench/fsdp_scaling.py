"""FSDP scaling of the bench's models: per-GPU tokens/s on N GPUs as a share of one GPU's, one host, one run.

    python bench/fsdp_scaling.py                                    # 1, 2 and 4 GPUs (those the host has), every model
    python bench/fsdp_scaling.py --gpus 1,2 --models transformer,gated_deltanet
    python bench/fsdp_scaling.py --device cpu --tiny --gpus 1,2      # smoke test: gloo ranks on the CPU

For each GPU count, one run of bench/train_throughput.py (the trainer's model builder and training step: bf16
autocast on one GPU, FSDP with bf16 parameters and float32 gradient reduction on several), the same models, lengths,
mode and steps: ``python`` on the first GPU for 1, ``torchrun --nproc_per_node N`` on the first N GPUs otherwise,
one run after the other, so that no run shares the host with another. The one-GPU run comes first and fills
Triton's autotuning cache (``TRITON_CACHE_AUTOTUNING=1``), so the ranks of the later runs do not each tune FLA's
kernels beside the others' collectives (docs/performance.md, "Several H200s with FSDP").

The runs on several GPUs profile one more step of each case (``--profile 1``): for every row under ``--target``
(95%) the output lists each rank's GPU timeline (compute kernels, NCCL kernels with no compute beside them, idle),
which tells links that are too slow (every rank in exposed NCCL) from ranks that wait for one another (one rank
idle, waiting for its host, while the others wait in NCCL). A run that ends early (``--timeout_s``) keeps the
cases it finished: the bench writes its results after every case. Prints the table and writes it into
docs/performance.md between ``<!-- bench_fsdp_scaling -->`` markers with the command, device and date. Exit status
0 when every case of every run finished.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from train_throughput import MODELS, add_run_options, write_section  # noqa: E402

MARKER = "bench_fsdp_scaling"


def bench_command(gpus: int, args: argparse.Namespace, report: Path) -> list[str]:
    bench = [str(REPO / "bench" / "train_throughput.py"), "--models", args.models, "--seq_lens", args.seq_lens,
             "--modes", args.mode, "--warmup", str(args.warmup), "--steps", str(args.steps), "--device",
             args.device, "--no_write", "--json", str(report)]  # fmt: skip
    if args.tiny:
        bench.append("--tiny")
    if gpus == 1:
        return [sys.executable, *bench]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus), *bench,
            "--profile", "1"]  # fmt: skip


def run_bench(gpus: int, args: argparse.Namespace, report: Path) -> tuple[dict | None, str]:
    """One bench run on ``gpus`` GPUs: its JSON record (None if it wrote none) and how it ended."""
    env = dict(os.environ, TRITON_CACHE_AUTOTUNING=os.environ.get("TRITON_CACHE_AUTOTUNING", "1"))
    if args.device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[:gpus])
    print(f"== {gpus} GPU{'s' * (gpus > 1)}: {' '.join(bench_command(gpus, args, report))}", flush=True)
    # Its own process group, which a timeout kills whole (torchrun's ranks would otherwise hold the GPUs).
    process = subprocess.Popen(bench_command(gpus, args, report), cwd=REPO, env=env, start_new_session=True)
    try:
        status = process.wait(timeout=args.timeout_s)
        ending = "finished" if status == 0 else f"exit status {status}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        ending = f"stopped after {args.timeout_s:.0f} s"
    record = json.loads(report.read_text()) if report.is_file() else None
    return record, ending


def tokens_per_s(record: dict | None, model: str, seq_len: int) -> tuple[float | None, dict | None]:
    for result in record["results"] if record else []:
        if result["model"] == model and result["seq_len"] == seq_len and not result["error"]:
            return result["tokens_per_s"], result
    return None, None


def scaling_table(records: dict[int, dict | None], endings: dict[int, str], args: argparse.Namespace) -> str:
    counts = sorted(records)
    header = ["model", "seq", "1 GPU tokens/s"] + [f"{n} GPUs tokens/s/GPU (share)" for n in counts if n > 1]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * (len(header) - 2)]
    below = []
    for model in args.models.split(","):
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            base, _ = tokens_per_s(records.get(1), model, seq_len)
            cells = [model, str(seq_len), f"{base:,.0f}" if base else "not measured"]
            for n in counts[1:]:
                value, result = tokens_per_s(records[n], model, seq_len)
                if value is None:
                    cells.append("not measured")
                    continue
                share = value / base if base else None
                cells.append(f"{value:,.0f}" + (f" ({share:.1%})" if share is not None else ""))
                if share is not None and share < args.target:
                    timelines = "; ".join(f"rank {r}: {t}" for r, t in enumerate(result["timelines"]))
                    below.append(
                        f"- {model}, seq {seq_len}, {n} GPUs ({share:.1%}): {timelines or 'no profile'}"
                    )
            lines.append("| " + " | ".join(cells) + " |")
    runs = "; ".join(f"{n} GPU{'s' * (n > 1)}: {endings[n]}" for n in counts)
    text = "\n".join(lines) + f"\n\nRuns: {runs}."
    if below:
        text += (
            f"\n\nRows under {args.target:.0%}, each rank's GPU timeline per profiled step:\n\n"
            + "\n".join(below)
        )
    return text


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default=None, help="comma separated GPU counts, 1 first (default 1,2,4: those "
                        "the host has)")  # fmt: skip
    parser.add_argument("--models", default=",".join(MODELS), help="comma separated: " + ", ".join(MODELS))
    parser.add_argument("--seq_lens", default=None, help="comma separated (default 2048; --tiny: 64)")
    parser.add_argument("--mode", default="compiled", choices=("eager", "compiled"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.95, help="share of one GPU's tokens/s per GPU")
    parser.add_argument("--timeout_s", type=float, default=1200, help="per run")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if unknown := set(args.models.split(",")) - set(MODELS):
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    available = torch.cuda.device_count() if args.device == "cuda" else 2
    counts = [int(n) for n in args.gpus.split(",")] if args.gpus else [n for n in (1, 2, 4) if n <= available]
    if counts[0] != 1 or len(counts) < 2 or counts != sorted(set(counts)):
        parser.error(f"--gpus must start at 1 and rise, with at least one count above 1; got {counts}")
    if args.device == "cuda" and counts[-1] > available:
        parser.error(f"--gpus {counts[-1]}: this host has {available} GPU(s)")
    args.gpus = counts
    args.seq_lens = args.seq_lens or ("64" if args.tiny else "2048")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    records, endings = {}, {}
    with tempfile.TemporaryDirectory() as work:
        for gpus in args.gpus:
            records[gpus], endings[gpus] = run_bench(gpus, args, Path(work) / f"{gpus}gpu.json")
    text = scaling_table(records, endings, args)
    print("\n" + text)
    device = next((r["device"] for r in records.values() if r), args.device)
    if not args.no_write:
        command = "python bench/fsdp_scaling.py " + " ".join(sys.argv[1:] if argv is None else argv)
        torch_version = next((r["torch"] for r in records.values() if r), torch.__version__)
        write_section(
            args.doc,
            MARKER,
            "FSDP scaling",
            f"Command: `{command.strip()}` on {args.gpus[-1]} x {device}, torch {torch_version} "
            f"({time.strftime('%Y-%m-%d')}); {args.mode}, {args.warmup} warm-up then {args.steps} timed steps per "
            "case, bench/train_throughput.py's default tokens per GPU (random tokens); per-GPU tokens/s on N GPUs "
            f"as a share of one GPU's from the same host in the same run. Total {time.perf_counter() - started:.0f} s.",
            text,
        )
    finished = all(ending == "finished" for ending in endings.values())
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
