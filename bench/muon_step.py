"""Muon's optimizer step against AdamW's over the same matrices, on one device and on N ranks in FSDP2's layout.

    python bench/muon_step.py                                   # one GPU, then 2 ranks if 2 GPUs are visible
    python bench/muon_step.py --ranks 1,2,4 --models transformer,gated_deltanet
    python bench/muon_step.py --device cpu --tiny --ranks 1,2   # gloo ranks on a CPU

The parameters are the matrices Muon takes from a bench model (``flame.optim.optimizer.muon_parameters`` of
bench/train_throughput.py's model, built on the meta device for their shapes), random, with random gradients. On
N ranks each matrix is laid out as FSDP2 lays it out, its rows sharded over a 1-D mesh (DTensor ``Shard(0)``).
Each case times ``optimizer.step()``, the device synchronised around each, for Muon (flame.optim.muon, in
``--ns_dtype``) and for the anchor, AdamW (fused on a GPU, foreach on a CPU), on the same parameters: the median
of ``--steps`` steps after two warm-up steps, the slowest rank's. Muon orthogonalises whole matrices: a stack of
same-shaped matrices is exchanged so that every rank iterates on 1/N of them, so its step should shrink with N
where the iteration's compute, not the exchange, sets it. Rank 0 prints the table and writes it into
docs/performance.md between ``<!-- bench_muon_step -->`` markers with the command, device and date.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import (  # noqa: E402
    MODELS,
    add_run_options,
    command_line,
    device_name,
    device_synchronize,
    model_config,
    write_section,
)

from flame.models import build_model, model_args_from_dict  # noqa: E402
from flame.optim.muon import Muon  # noqa: E402
from flame.optim.optimizer import muon_parameters  # noqa: E402

MARKER = "bench_muon_step"
WARMUP = 2


def matrix_shapes(name: str, args) -> list[tuple[int, int]]:
    """The shapes of the matrices Muon takes from the bench model ``name`` (``--hidden_size``: at that width)."""
    config = model_config(name, args.tiny, args.num_layers)
    if args.hidden_size:
        config["hidden_size"] = args.hidden_size
    with torch.device("meta"):
        model = build_model(model_args_from_dict(config)[0])
    return [tuple(param.shape) for param in muon_parameters(model)]


def parameters(shapes, device: torch.device, mesh) -> list[torch.nn.Parameter]:
    """Random matrices of ``shapes`` with random gradients, the same on every rank; rows sharded over ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes:
        weight, grad = (torch.randn(shape, device=device, generator=generator) for _ in range(2))
        if mesh is not None:
            weight, grad = (distribute_tensor(t, mesh, [Shard(0)]) for t in (weight, grad))
        param = torch.nn.Parameter(weight)
        param.grad = grad
        params.append(param)
    return params


def step_seconds(optimizer, device: torch.device, steps: int) -> float:
    """The median time of ``optimizer.step()`` over ``steps`` steps after the warm-up, the device synchronised."""
    times = []
    for index in range(WARMUP + steps):
        device_synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        device_synchronize(device)
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_rank(rank: int, ranks: int, rendezvous: str, args, results) -> None:
    """This rank's cases: every model, Muon then AdamW; the slowest rank's time goes into ``results``."""
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    mesh = None
    if ranks > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=ranks)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (ranks,))
    try:
        for name in args.models.split(","):
            shapes = matrix_shapes(name, args)
            row = {
                "model": name,
                "ranks": ranks,
                "matrices": len(shapes),
                "elements": sum(m * n for m, n in shapes),
            }
            for optimizer_name in ("Muon", "AdamW"):
                params = parameters(shapes, device, mesh)
                if optimizer_name == "Muon":
                    optimizer = Muon(params, lr=1e-3, weight_decay=0.1, ns_dtype=args.ns_dtype)
                else:
                    fused = device.type == "cuda"
                    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=fused, foreach=not fused)
                seconds = torch.tensor(step_seconds(optimizer, device, args.steps), device=device)
                if mesh is not None:
                    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                row[optimizer_name] = seconds.item()
                del optimizer, params
            if rank == 0:
                results.append(row)
                print(
                    f"{name}, {ranks} rank(s): Muon {row['Muon'] * 1e3:.1f} ms, AdamW {row['AdamW'] * 1e3:.1f} ms",
                    flush=True,
                )
    finally:
        if mesh is not None:
            dist.destroy_process_group()


def _spawned(rank: int, ranks: int, rendezvous: str, args, out: str) -> None:
    results = []
    run_rank(rank, ranks, rendezvous, args, results)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run(ranks: int, args) -> list[dict]:
    if ranks == 1:
        results = []
        run_rank(0, 1, "", args, results)
        return results
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "results")
        mp.spawn(
            _spawned, args=(ranks, os.path.join(folder, "rendezvous"), args, out), nprocs=ranks, join=True
        )
        return json.loads(Path(out).read_text())


def table(rows: list[dict]) -> str:
    lines = [
        "| model | matrices | elements | ranks | Muon step ms | AdamW step ms (anchor) | Muon / AdamW |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['matrices']} | {r['elements']:,} | {r['ranks']} | {r['Muon'] * 1e3:.1f} | "
            f"{r['AdamW'] * 1e3:.1f} | {r['Muon'] / r['AdamW']:.2f}x |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="transformer,gated_deltanet", help="comma separated: " + ", ".join(MODELS)
    )
    parser.add_argument(
        "--ranks", default=None, help="comma separated rank counts (default: 1, and 2 with 2 GPUs)"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case, after two warm-up steps")
    parser.add_argument("--ns_dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--num_layers", type=int, default=None, help="blocks of the model (default: its config's)"
    )
    parser.add_argument(
        "--hidden_size", type=int, default=None, help="the model's width (default: its config's)"
    )
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.ranks is None:
        gpus = torch.cuda.device_count() if args.device == "cuda" else 1
        args.ranks = "1,2" if gpus >= 2 else "1"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU is visible: use --device cpu", file=sys.stderr)
        return 1
    counts = [int(n) for n in args.ranks.split(",")]
    if args.device == "cuda" and max(counts) > torch.cuda.device_count():
        print(
            f"--ranks {args.ranks} needs {max(counts)} GPUs; {torch.cuda.device_count()} are visible",
            file=sys.stderr,
        )
        return 1
    started = time.time()
    rows = [row for ranks in counts for row in run(ranks, args)]
    text = table(rows)
    print(text)
    if not args.no_write:
        device = torch.device("cuda") if args.device == "cuda" else torch.device("cpu")
        shape = "".join(
            [
                " (tiny configs)" if args.tiny else "",
                f", {args.num_layers} blocks" if args.num_layers else "",
                f", hidden size {args.hidden_size}" if args.hidden_size else "",
            ]
        )
        description = (
            f"Command: `{command_line('bench/muon_step.py', argv)}` on {device_name(device)}, torch "
            f"{torch.__version__} ({datetime.date.today()}); the matrices Muon takes from each model{shape}, rows "
            f"sharded over the ranks as FSDP2 shards them, Newton-Schulz in {args.ns_dtype}; the median step of "
            f"{args.steps} after {WARMUP} warm-up steps, the slowest rank's. Total {time.time() - started:.0f} s."
        )
        write_section(args.doc, MARKER, "Muon's step", description, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
