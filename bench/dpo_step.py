"""DPO step time of a GatedDeltaNet hybrid against a transformer of the same size class, and their ratio.

    python bench/dpo_step.py                                  # one GPU
    torchrun --nproc_per_node 4 bench/dpo_step.py             # FSDP over 4 GPUs, the same pairs per GPU
    python bench/dpo_step.py --device cpu --tiny              # smoke test of the script itself

The measurement of the hybrid-DPO investigation (shared/seeds): a 7B hybrid was 7% faster than a 7B transformer on
one GPU and ~16x slower under ZeRO-3 on 32, because per-parameter all-gathers hit the hybrid's many small tensors.
flame runs both with FSDP2 per block, so a block's parameters are gathered in one collective whatever their number.

Each case is the trainer's DPO step (``build_model_parts``, ``build_train_step`` with ``DPOObjective``: policy
forward + backward and the frozen reference's forward on the same rows) with full activation checkpointing on random
pairs: ``--pairs`` pairs of ``--seq_len`` tokens per reply per GPU (default 1 x 8192: 16,384 tokens per step and
GPU). The models: configs/transformer_1B.json and configs/gated_deltanet_1B.json with softmax attention at every
fourth layer (3, 7, ...), 16 heads, QK-norm (the OLMo-3 hybrid pattern). Rank 0 prints a table (step time, tokens/s
per GPU, peak memory, and hybrid / transformer step time) and writes it into docs/performance.md between
``<!-- bench_dpo_step_<N>gpu -->`` markers.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torchtitan  # noqa: E402,F401  (the real package before flame.config: see compat.torchtitan_job_config)
from train_throughput import (  # noqa: E402
    add_run_options,
    cleanup,
    command_line,
    device_name,
    millions,
    profile_steps,
    write_section,
)

from flame import compat  # noqa: E402
from flame.config import parse_args  # noqa: E402
from flame.models import get_model_spec, read_model_config  # noqa: E402
from flame.train.model_parts import Topology, build_model_parts  # noqa: E402
from flame.train.objective import build_objective  # noqa: E402
from flame.train.step import build_train_step  # noqa: E402

MODELS = {
    "transformer": ("configs/transformer_1B.json", {}),
    "hybrid": ("configs/gated_deltanet_1B.json", {"attn": {"every": 4, "offset": 3, "num_heads": 16, "qk_norm": True}}),
}  # fmt: skip
TINY = {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 256, "intermediate_size": 128}
TINY_FAMILY = {"transformer": {"num_heads": 4}, "hybrid": {"num_heads": 2, "head_dim": 32}}


def model_args(name: str, tiny: bool):
    path, overrides = MODELS[name]
    config = {**read_model_config(REPO / path), **overrides}
    if tiny:
        config.update(TINY, **TINY_FAMILY[name])
        if "attn" in config:
            config["attn"] = {**config["attn"], "num_heads": 4}
    args, _ = get_model_spec(config["model_type"]).args_cls.from_dict(config)
    return args


def run_case(name: str, args, device, parallel_dims) -> dict:
    """Seconds per DPO step (after warm-up), tokens/s per GPU and peak GiB of one model."""
    world = parallel_dims.world_size
    config = parse_args(
        ["--job.task", "dpo", "--training.seq_len", str(args.seq_len),
         "--training.batch_size", str(args.pairs), "--parallelism.data_parallel_shard_degree", str(world),
         "--activation_checkpoint.mode", args.ac, "--optimizer.lr", "1e-6"]
        + (["--compile.enable"] if args.compile else [])
    )  # fmt: skip
    margs = model_args(name, args.tiny)
    topology = Topology.of(parallel_dims, device)
    policy = build_model_parts(margs, topology, config)
    step = build_train_step(policy, topology, config, objective=build_objective(margs, topology, config))
    generator = torch.Generator(device=device).manual_seed(topology.dp_rank)
    tokens = torch.randint(
        0, margs.vocab_size, (2 * args.pairs, args.seq_len + 1), device=device, generator=generator
    )
    labels = tokens[:, 1:].clone()
    labels[:, : args.seq_len // 4] = -100  # the prompt: a quarter of each row
    batches = [({"input": tokens[:, :-1]}, labels)]
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for _ in range(args.warmup):
        step(batches)
    synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(batches)
    synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    timelines = []
    if args.profile:
        _, timeline = profile_steps(lambda: step(batches), args.profile, device)
        timelines = [timeline] * world
        if dist.is_initialized():
            dist.all_gather_object(timelines, timeline)
    return {
        "params": policy.nparams,
        "step_s": seconds,
        "tokens_per_s": labels.numel() / seconds,
        "peak_gib": peak,
        "timelines": timelines,
    }


def table(results: dict[str, dict], world: int) -> str:
    lines = [
        "| model | params | GPUs | step s | tokens/s/GPU | peak GiB | step / transformer's |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = results.get("transformer", {}).get("step_s")
    for name, r in results.items():
        ratio = f"{r['step_s'] / base:.3f}" if base else "n/a"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] == r["peak_gib"] else "n/a"
        lines.append(f"| {name} | {millions(r['params'])} | {world} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {peak} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="transformer,hybrid")
    parser.add_argument(
        "--seq_len", type=int, default=None, help="tokens per reply (default 8192; --tiny: 64)"
    )
    parser.add_argument("--pairs", type=int, default=1, help="preference pairs per GPU per step")
    parser.add_argument("--ac", default="full", choices=["none", "full", "selective"])
    parser.add_argument("--compile", action="store_true", help="per-block torch.compile")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; --tiny: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --tiny: 1)")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="profile this many more steps per model; print each rank's GPU timeline",
    )
    add_run_options(parser)
    args = parser.parse_args(argv)
    defaults = (
        {"seq_len": 64, "warmup": 1, "steps": 1} if args.tiny else {"seq_len": 8192, "warmup": 2, "steps": 5}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from torchtitan.distributed import ParallelDims

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    compat.apply()
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world
    )
    if world > 1:
        parallel_dims.build_mesh()
    started, results = time.perf_counter(), {}
    for name in args.models.split(","):
        results[name] = run_case(name, args, device, parallel_dims)
        cleanup(device)
        if rank == 0:
            print(table({name: results[name]}, world).splitlines()[-1], flush=True)
            for r, timeline in enumerate(results[name]["timelines"]):
                print(f"  rank {r}: {timeline}", flush=True)
    if rank == 0:
        text = table(results, world)
        print("\n" + text)
        if not args.no_write:
            launcher = ("torchrun", "--nproc_per_node", str(world)) if world > 1 else ("python",)
            command = command_line("bench/dpo_step.py", argv, launcher)
            write_section(
                args.doc,
                f"bench_dpo_step_{world}gpu",
                f"DPO step, hybrid against transformer, {world} {'GPU' if device.type == 'cuda' else 'CPU'}{'s' * (world > 1)}",
                f"Command: `{command}` on {world} x {device_name(device)}, torch {torch.__version__} "
                f"({time.strftime('%Y-%m-%d')}); {args.pairs} pair(s) of {args.seq_len} tokens per reply per GPU, "
                f"activation checkpointing {args.ac}, {'compiled' if args.compile else 'eager'}, "
                f"{'FSDP2 per block' if world > 1 else 'one device'}, {args.warmup} warm-up then {args.steps} "
                f"timed steps (policy forward + backward, reference forward). Total {time.perf_counter() - started:.0f} s.",
                text,
            )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
