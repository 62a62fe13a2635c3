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
(95%) the output gives the step's time and the host's time to issue it (the bench's "host s") on N GPUs and on one,
and lists each rank's GPU timeline (compute kernels, NCCL kernels with no compute beside them, idle) and host time
in each phase of the step (forward + backward, gradient clipping, optimizer),
which tells links that are too slow (every rank in exposed NCCL) from ranks that wait for one another (one rank
idle, waiting for its host, while the others wait in NCCL). Each run on several GPUs also measures the link: the bus
bandwidth of FSDP's all-gather and reduce-scatter, and on GPUs the pairs' connection in ``nvidia-smi topo -m``
(NV# is NVLink; PIX, PXB, PHB, NODE and SYS are PCIe paths). A run that ends early (``--timeout_s``) keeps the
cases it finished: the bench writes its results after every case. Prints the table and writes it into
docs/performance.md between ``<!-- bench_fsdp_scaling -->`` markers with the command, device and date. Exit status
0 when every case of every run finished.

``--data_parallel ddp`` runs the same cases with DDP on several GPUs instead (the parameters replicated, the
gradients all-reduced in buckets by DDP's C++ reducer, so the host issues far less per step than FSDP's Python
hooks) and writes its table into its own section, "DDP scaling". ``--data_parallel fsdp,ddp`` runs both against one
one-GPU run. ``--host NAME`` gives the tables sections of their own ("FSDP scaling, host NAME"), beside other
hosts'.

A host's models can be measured in several invocations (a device call with a time limit) and written as one table:

    python bench/fsdp_scaling.py --models transformer,gated_deltanet --json a.json --no_write
    python bench/fsdp_scaling.py --models hybrid,llama --json b.json --no_write
    python bench/fsdp_scaling.py --merge a.json b.json

The --json file is rewritten after every run, so a call stopped by its time limit keeps the runs it finished; SIGTERM
(``timeout``'s signal) stops the running bench's processes too.
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

from families import stop_on_sigterm  # noqa: E402
from train_throughput import MODELS, add_run_options, command_line, write_section  # noqa: E402

MARKER = "bench_fsdp_scaling"
DDP_MARKER = "bench_ddp_scaling"


def bench_command(gpus: int, args: argparse.Namespace, report: Path, kind: str = "fsdp") -> list[str]:
    bench = [str(REPO / "bench" / "train_throughput.py"), "--models", args.models, "--seq_lens", args.seq_lens,
             "--modes", args.mode, "--warmup", str(args.warmup), "--steps", str(args.steps), "--device",
             args.device, "--no_write", "--json", str(report)]  # fmt: skip
    if args.tiny:
        bench.append("--tiny")
    if args.job_flags:
        bench += ["--job_flags", args.job_flags]
    if kind == "ddp" and gpus > 1:
        bench += ["--data_parallel", "ddp"]
    if gpus == 1:
        return [sys.executable, *bench]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus), *bench,
            "--profile", "1"]  # fmt: skip


def run_bench(
    gpus: int, args: argparse.Namespace, report: Path, kind: str = "fsdp"
) -> tuple[dict | None, str]:
    """One bench run on ``gpus`` GPUs (``kind``: fsdp or ddp): its JSON record (None if it wrote none) and how it
    ended."""
    env = dict(os.environ, TRITON_CACHE_AUTOTUNING=os.environ.get("TRITON_CACHE_AUTOTUNING", "1"))
    if args.device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[:gpus])
    command = bench_command(gpus, args, report, kind)
    print(f"== {gpus} GPU{'s' * (gpus > 1)}: {' '.join(command)}", flush=True)
    # Its own process group, which a timeout or this script's own end kills whole (torchrun's ranks would otherwise
    # hold the GPUs).
    process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)
    try:
        status = process.wait(timeout=args.timeout_s)
        ending = "finished" if status == 0 else f"exit status {status}"
    except subprocess.TimeoutExpired:
        ending = f"stopped after {args.timeout_s:.0f} s"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    record = json.loads(report.read_text()) if report.is_file() else None
    return record, ending


def tokens_per_s(record: dict | None, model: str, seq_len: int) -> tuple[float | None, dict | None]:
    for result in record["results"] if record else []:
        if result["model"] == model and result["seq_len"] == seq_len and not result["error"]:
            return result["tokens_per_s"], result
    return None, None


def host_time(result: dict, single: dict) -> str:
    """The step's time beside the host's time to issue it, on N GPUs and on one (records without host times, from
    before the bench measured them, say so)."""
    if "host_s" not in result or "host_s" not in single:
        return "host time not measured"
    return (
        f"step {result['step_s']:.3f} s, the host issues it in {result['host_s']:.3f} s "
        f"(1 GPU: step {single['step_s']:.3f} s, host {single['host_s']:.3f} s)"
    )


def gpu_links(device: str) -> str:
    """How the GPUs are connected: each kind of connection in ``nvidia-smi topo -m`` between two GPUs, with the pairs
    it joins; empty off GPUs or without nvidia-smi."""
    if device != "cuda":
        return ""
    try:
        matrix = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return links_of_matrix(matrix)


def links_of_matrix(matrix: str) -> str:
    rows = [line.split() for line in matrix.splitlines() if line.startswith("GPU")]  # the header is indented
    if not rows:
        return ""
    gpus = [row[0] for row in rows]
    pairs: dict[str, list[str]] = {}
    for i, row in enumerate(rows):
        for j in range(i + 1, len(gpus)):
            pairs.setdefault(row[1 + j], []).append(f"{i}-{j}")
    return "; ".join(f"{kind} ({', '.join(joined)})" for kind, joined in pairs.items())


def scaling_table(
    records: dict[int, dict | None],
    endings: dict[int, str],
    models: list[str],
    seq_lens: list[int],
    target: float,
) -> str:
    counts = sorted(records)
    header = ["model", "seq", "1 GPU tokens/s"] + [f"{n} GPUs tokens/s/GPU (share)" for n in counts if n > 1]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * (len(header) - 2)]
    below = []
    for model in models:
        for seq_len in seq_lens:
            base, single = tokens_per_s(records.get(1), model, seq_len)
            cells = [model, str(seq_len), f"{base:,.0f}" if base else "not measured"]
            for n in counts[1:]:
                value, result = tokens_per_s(records[n], model, seq_len)
                if value is None:
                    cells.append("not measured")
                    continue
                share = value / base if base else None
                cells.append(f"{value:,.0f}" + (f" ({share:.1%})" if share is not None else ""))
                if share is not None and share < target:
                    timelines = "; ".join(f"rank {r}: {t}" for r, t in enumerate(result["timelines"]))
                    below.append(
                        f"- {model}, seq {seq_len}, {n} GPUs ({share:.1%}): {host_time(result, single)}; "
                        f"{timelines or 'no profile'}"
                    )
            lines.append("| " + " | ".join(cells) + " |")
    runs = "; ".join(f"{n} GPU{'s' * (n > 1)}: {', '.join(endings[n])}" for n in counts)
    text = "\n".join(lines) + f"\n\nRuns: {runs}."
    bandwidth = [
        f"{n} GPUs: "
        + ", ".join(f"{name} {value:.1f} GB/s" for name, value in record["link_bus_GBps"].items())
        for n, record in sorted(records.items())
        if record and record.get("link_bus_GBps")
    ]
    if bandwidth:
        text += f"\n\nLink bus bandwidth (64 MiB per call, slowest rank): {'; '.join(bandwidth)}."
    if below:
        text += f"\n\nRows under {target:.0%}, each rank's GPU timeline per profiled step:\n\n" + "\n".join(
            below
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
    parser.add_argument("--job_flags", default="", help="train.sh flags the bench adds to every case's job")
    parser.add_argument("--data_parallel", default="fsdp",
                        help="how the runs on several GPUs split the model: fsdp (per block), ddp (replicated "
                        "parameters, C++ gradient buckets; its own section, DDP scaling), or fsdp,ddp: both, "
                        "against one one-GPU run")  # fmt: skip
    parser.add_argument(
        "--host", default="", help="a name for this host: its tables get sections of their own"
    )
    parser.add_argument("--json", type=Path, default=None, help="also keep this invocation's runs here")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="run nothing: one table from the --json files of earlier invocations on one host")  # fmt: skip
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.merge:
        return args
    args.data_parallel = args.data_parallel.split(",")
    if not args.data_parallel or set(args.data_parallel) - {"fsdp", "ddp"}:
        parser.error(f"--data_parallel takes fsdp, ddp or fsdp,ddp; got {','.join(args.data_parallel)}")
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


def measure(args: argparse.Namespace, command: str) -> list[dict]:
    """This invocation's runs, one GPU count after the other, as the --json file keeps them: one entry per kind of
    data parallelism, each with the one-GPU run (its seconds count in each); the file is rewritten after every run."""
    links = gpu_links(args.device)
    runs = [{"command": command, "models": args.models.split(","), "seq_lens": [int(s) for s in args.seq_lens.split(",")],
             "mode": args.mode, "data_parallel": kind, "warmup": args.warmup, "steps": args.steps,
             "target": args.target, "links": links, "date": time.strftime("%Y-%m-%d"), "records": {}, "endings": {},
             "seconds": 0} for kind in args.data_parallel]  # fmt: skip
    with tempfile.TemporaryDirectory() as work:

        def run(gpus: int, kind: str, targets: list[dict]) -> None:
            started = time.perf_counter()
            outcome = run_bench(gpus, args, Path(work) / f"{gpus}gpu-{kind}.json", kind)
            for target in targets:
                target["records"][str(gpus)], target["endings"][str(gpus)] = outcome
                target["seconds"] += round(time.perf_counter() - started)
            if args.json:
                args.json.write_text(json.dumps(runs, indent=1))

        run(1, "fsdp", runs)  # one GPU: no data parallelism, the baseline of every kind
        for kind_runs in runs:
            for gpus in args.gpus[1:]:
                run(gpus, kind_runs["data_parallel"], [kind_runs])
    return runs


def combine(runs: list[dict]) -> tuple[dict[int, dict | None], dict[int, list[str]]]:
    """The runs of several invocations by GPU count: their results side by side, and how each ended."""
    records, endings = {}, {}
    for run in runs:
        for key, record in run["records"].items():
            n = int(key)  # JSON keeps the counts as strings
            if records.get(n) is None:
                records[n] = None if record is None else dict(record, results=list(record["results"]))
            elif record is not None:
                records[n]["results"] += record["results"]
            endings.setdefault(n, []).append(run["endings"][key])
    return records, endings


def read_runs(path: Path) -> list[dict]:
    """A --json file's runs: a list, or one run from before --data_parallel took several kinds."""
    runs = json.loads(path.read_text())
    return runs if isinstance(runs, list) else [runs]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop_on_sigterm()
    command = command_line("bench/fsdp_scaling.py", argv)
    runs = (
        [run for path in args.merge for run in read_runs(path)]
        if args.merge
        else measure(args, command.strip())
    )
    finished = True
    for kind in ("fsdp", "ddp"):
        # Records from before --data_parallel are FSDP's.
        kind_runs = [run for run in runs if run.get("data_parallel", "fsdp") == kind]
        if kind_runs:
            finished &= write_table(kind, kind_runs, args, command.strip())
    return 0 if finished else 1


def write_table(kind: str, runs: list[dict], args: argparse.Namespace, command: str) -> bool:
    """Prints one kind's table (and writes its section); whether every run finished."""
    records, endings = combine(runs)
    models = list(dict.fromkeys(model for run in runs for model in run["models"]))
    seq_lens = list(dict.fromkeys(seq_len for run in runs for seq_len in run["seq_lens"]))
    text = scaling_table(records, endings, models, seq_lens, runs[0]["target"])
    title = f"{kind.upper()} scaling" + (f", host {args.host}" if args.host else "")
    print(f"\n{title}\n\n{text}")
    device = next((r["device"] for r in records.values() if r), args.device)
    if not args.no_write:
        torch_version = next((r["torch"] for r in records.values() if r), torch.__version__)
        commands = " then ".join(f"`{c}`" for c in dict.fromkeys(run["command"] for run in runs))
        links = next((run["links"] for run in runs if run.get("links")), "")
        first = runs[0]
        marker = (MARKER if kind == "fsdp" else DDP_MARKER) + (f"_{args.host}" if args.host else "")
        write_section(
            args.doc,
            marker,
            title,
            f"Command{'s' * (len(runs) > 1)}: {commands}"
            + (f" (one table by `{command}`)" if args.merge else "")
            + f" on {max(records)} x {device}, torch {torch_version} ({first['date']}); {first['mode']}, {first['warmup']} warm-up then {first['steps']} timed "
            "steps per case, bench/train_throughput.py's default tokens per GPU (random tokens); per-GPU tokens/s "
            "on N GPUs as a share of one GPU's from the same host in the same run. Total "
            f"{sum(run['seconds'] for run in runs):.0f} s."
            + (f" GPU links (nvidia-smi topo -m): {links}." if links else ""),
            text,
        )
    return all(ending == "finished" for run_endings in endings.values() for ending in run_endings)


if __name__ == "__main__":
    sys.exit(main())
