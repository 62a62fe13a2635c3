"""Training throughput of flame's models on this machine's GPUs: tokens/s per GPU, MFU, peak memory, step time.

    python bench/train_throughput.py [--quick]                          # one GPU
    torchrun --nproc_per_node 4 bench/train_throughput.py [--quick]     # FSDP over 4 GPUs (per-GPU batch unchanged)
    torchrun --nproc_per_node 4 bench/train_throughput.py --cp 2 ...   # context parallel 2 x FSDP 2
    python bench/train_throughput.py --device cpu --tiny                # smoke test of the script itself
    python bench/train_throughput.py --activations none,full,offload,full+offload --optimizers AdamW,Muon
    python bench/train_throughput.py --anchor --models transformer --seq_lens 2048   # beside the naive HF loop

Each case runs the trainer's own model builder and training step (``build_model_parts`` and ``TrainStep`` in
flame/train/): the model built on the meta device and parallelized with the job's plan (per-block torch.compile in
the compiled mode; FSDP with bf16 parameters and float32 gradient reduction when several processes run, bf16
autocast on one GPU), flame's optimizer and LR schedule, the summed cross-entropy (compiled in the compiled mode
unless ``--compile_components`` leaves "loss" out) over the step's global labelled-token count, gradient clipping.
Batches are random tokens (no dataset), ``--tokens_per_gpu`` per step (batch = tokens // seq_len), or with ``--data
real`` come through flame's data path as train.sh feeds the trainer: the dataloader on ``--dataset`` (default: the
shipped corpus and tokenizer; the model's vocabulary grows to the tokenizer's if smaller), its workers (the trainer's
choice unless ``--num_workers``) and the device prefetcher, the next step's batch fetched and copied while a step
runs; the "data wait" column is the share of the timed steps spent waiting for the loader. Each case runs
``--warmup`` steps (compilation, allocator warm-up), then ``--steps`` timed steps, then three more that time the
host alone: "host s" is the median time the host takes to issue a step whose GPU is idle at its start. A step
whose host time reaches its step time is bound by the host (Python, FSDP's hooks, the optimizer's dispatch), not
by its kernels; under FSDP every rank then waits for the slowest host. ``--fake_world N`` runs one process as rank 0
of N whose collectives do nothing: FSDP's host work alone, measurable on a CPU (``--device cpu --tiny
--fake_world 2``). ``--data_parallel ddp`` replicates the model over the ranks with DDP instead of sharding it with
FSDP. With ``--cp N`` each row is split
over the N ranks of a context-parallel group by the step, as in training: a group reads batch = tokens x N //
seq_len rows, so every GPU still holds ``--tokens_per_gpu`` tokens, and FSDP shards over the data-parallel x cp
ranks.

Cases: every model in ``--models`` x ``--seq_lens`` x ``--modes`` (eager, compiled) x ``--activations`` (what
the blocks keep for backward: none, activation checkpointing full or selective, offload to host memory, or full
checkpointing with the checkpoints offloaded: full+offload) x ``--optimizers`` (AdamW, Muon). ``--job_flags``
adds train.sh flags to every case's job (``--job_flags "--optimizer.implementation foreach"``). The models are the 340M
configs transformer_340M, the softpick recipes (softpick, rectified, scaled softpick), gated_deltanet_340M, and a
hybrid: gated_deltanet_340M with attention (16 heads, QK-norm) at every fourth layer (3, 7, 11, 15, 19), the OLMo-3
hybrid pattern, gated_deltanet_k128 (gated_deltanet_340M with K = V = 128 heads), and llama: transformers'
LlamaForCausalLM through flame's generic family at transformer_340M's shape. A path ending in ``.json`` in
``--models`` is any ``--model.config`` file (an FLA family's config, say), built as train.sh builds it. ``--anchor`` (one GPU) first times each model and length in the naive loop a user writes without
flame (the class of the model's HF export, eager, bf16 autocast, fused AdamW, the class's own loss on the same
random tokens) and gives every row its ratio to that loop.

MFU = FLOPs per token (the model args' get_nparams_and_flops, docs/metrics.md: weights, attention and
linear-attention terms, attention counted as torchtitan does) x tokens/s per GPU / peak; peak is 989 TFLOP/s (H100/H200 dense bf16), ``--peak_tflops``
otherwise. "peak GiB" is the GPU's peak allocated memory, and for the cases that offload activations the host
memory they took at their peak (pinned, as the host allocator rounds it). Rank 0 prints a markdown table and writes
it into docs/performance.md between
``<!-- bench_train_throughput_<N>gpu -->`` markers (N = number of GPUs; other sections are kept).
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import itertools
import json
import os
import re
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.autograd import DeviceType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torchtitan  # noqa: E402,F401  (the real package before flame.config: see compat.torchtitan_job_config)
from torchtitan.tools.utils import GarbageCollection  # noqa: E402

from flame import compat  # noqa: E402
from flame.config import parse_args  # noqa: E402
from flame.models import model_args_from_dict, read_model_config  # noqa: E402
from flame.ops.attention import ATTENTION_BACKENDS  # noqa: E402
from flame.parallelize.activation_offload import host_peak_gib  # noqa: E402
from flame.train.model_parts import Topology, build_model_parts  # noqa: E402
from flame.train.step import STEP_REGIONS, build_train_step  # noqa: E402

PERFORMANCE_DOC = REPO / "docs" / "performance.md"
DEFAULT_DATASET = REPO / "flame" / "assets" / "corpus"  # the embedded default job's data and tokenizer
DEFAULT_TOKENIZER = REPO / "flame" / "assets" / "tokenizer"
H100_BF16_PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM and H200 alike
ACTIVATIONS = ("none", "full", "selective", "offload", "full+offload")
LONG_CONTEXT = 8192  # longer sequences get sections of their own (the seed recipe's 65536-token varlen job)
HYBRID_ATTN = {"every": 4, "offset": 3, "num_heads": 16, "qk_norm": True}
MODELS = {
    "transformer": ("configs/transformer_340M.json", {}),
    "softpick_transformer": ("configs/softpick_transformer_340M.json", {}),
    "rectified_transformer": ("configs/rectified_transformer_340M.json", {}),
    "scaled_softpick_transformer": ("configs/scaled_softpick_transformer_340M.json", {}),
    "gated_deltanet": ("configs/gated_deltanet_340M.json", {}),
    "hybrid": ("configs/gated_deltanet_340M.json", {"attn": HYBRID_ATTN}),
    # K = V = 128 heads (Qwen3-Next's shape), which FlashQLA serves where installed (flame/ops/gated_delta_rule).
    "gated_deltanet_k128": ("configs/gated_deltanet_340M.json", {"head_dim": 128, "expand_v": 1}),
    # transformers' Llama through the generic family, at transformer_340M's shape (its SwiGLU width 2816 included).
    "llama": (None, {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
                     "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                     "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
}  # fmt: skip
# --tiny: the same families at a size a CPU steps through in well under a second.
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, "intermediate_size": 128}
TINY_FAMILY = {
    "transformer": {"num_heads": 4},
    "softpick_transformer": {"num_heads": 4},
    "rectified_transformer": {"num_heads": 4},
    "scaled_softpick_transformer": {"num_heads": 4},
    "gated_deltanet": {"num_heads": 2, "head_dim": 32},
    "hybrid": {"num_heads": 2, "head_dim": 32, "attn": {"layers": [1], "num_heads": 4, "qk_norm": True}},
    "gated_deltanet_k128": {"num_heads": 2, "head_dim": 32, "expand_v": 1},
    "llama": {"num_attention_heads": 4, "num_key_value_heads": 4},
}


@dataclass
class Result:
    model: str
    params: int
    seq_len: int
    batch: int
    mode: str
    activations: str
    optimizer: str
    step_s: float = float("nan")
    host_s: float = float("nan")  # the host's time to issue one step, its GPU idle at the start
    tokens_per_s: float = float("nan")
    tflops: float = float("nan")
    mfu: float = float("nan")
    peak_gib: float = float("nan")
    host_gib: float | None = None  # activation offloading: the host memory the activations took at their peak
    data_wait: float = float("nan")  # --data real: share of the timed steps spent waiting for the loader
    error: str = ""
    profile: str = ""  # rank 0's top kernels
    # Every rank's GPU timeline and host time per step phase: the rank the others wait for is the one whose NCCL
    # kernels wait least.
    timelines: tuple[str, ...] = ()
    # Compiled cases: the places torch.compile broke the blocks' or the loss's graphs (dynamo counts each once, when
    # it traces); each costs the host a return to Python at every call.
    graph_breaks: int | None = None


def model_config(name: str, tiny: bool, num_layers: int | None = None) -> dict:
    """The bench model's config, as a --model.config JSON holds it: one of MODELS, or a config file's path."""
    path, overrides = MODELS.get(name, (name, {}))
    config = {**(read_model_config(REPO / path) if path else {}), **overrides}
    if tiny:
        config.update(TINY, **TINY_FAMILY[name])
    if num_layers:
        config["num_hidden_layers"] = num_layers
    return config


def model_args(name: str, tiny: bool, num_layers: int | None = None):
    args, _ = model_args_from_dict(model_config(name, tiny, num_layers))
    return args


def activation_flags(activations: str) -> list[str]:
    """none, full, selective, offload or full+offload as job flags."""
    checkpoint, _, offload = activations.partition("+")
    if checkpoint == "offload":
        checkpoint, offload = "none", "offload"
    return ["--activation_checkpoint.mode", checkpoint,
            "--activation_offload.mode", "full" if offload else "none"]  # fmt: skip


def data_parallel_flags(degree: int, kind: str) -> list[str]:
    """The job's data-parallel degrees: ``degree`` ranks sharding (FSDP) or replicating (DDP) the model."""
    shard, replicate = (degree, 1) if kind == "fsdp" or degree == 1 else (1, degree)
    return ["--parallelism.data_parallel_shard_degree", str(shard),
            "--parallelism.data_parallel_replicate_degree", str(replicate)]  # fmt: skip


def job_config(
    seq_len: int, compiled: bool, world_size: int, args, activations: str = "none", optimizer: str = "AdamW"
):
    flags = ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(rows_per_step(args, seq_len)),
             "--training.dataset", args.dataset, "--model.tokenizer_path", args.tokenizer,
             *data_parallel_flags(world_size // args.cp, args.data_parallel),
             "--parallelism.context_parallel_degree", str(args.cp),
             *activation_flags(activations), "--optimizer.name", optimizer, "--optimizer.lr", "3e-4",
             "--model.attention_backend", args.attention_backend,
             "--parallelism.fsdp_reshard_after_forward", args.fsdp_reshard_after_forward]  # fmt: skip
    if args.num_workers is not None:
        flags += ["--training.num_workers", str(args.num_workers)]
    flags += shlex.split(args.job_flags)
    if compiled:
        flags += ["--compile.enable", "--compile.backend", args.compile_backend,
                  "--compile.components", args.compile_components]  # fmt: skip
    return parse_args(flags)


def rows_per_step(args, seq_len: int) -> int:
    """Rows per step of a context-parallel group (one GPU without CP); each of its ranks holds a 1/cp slice."""
    return max(1, args.tokens_per_gpu * args.cp // seq_len)


def run_case(name, seq_len, mode, activations, optimizer, args, device, parallel_dims) -> Result:
    """One case through the trainer's own builder and step (build_model_parts, TrainStep) on random tokens, or
    on the trainer's data path (--data real)."""
    world_size = parallel_dims.world_size
    margs = model_args(name, args.tiny, args.num_layers)
    batch = rows_per_step(args, seq_len)
    config = job_config(seq_len, mode == "compiled", world_size, args, activations, optimizer)
    topology = Topology.of(parallel_dims, device)
    data = None
    if args.data == "real":
        # Here, not at the top: the data stack imports transformers and datasets, which random tokens never need.
        from flame.data import build_dataloader, build_tokenizer
        from flame.data.prefetch import DevicePrefetcher

        tokenizer = build_tokenizer(config)
        margs.vocab_size = max(margs.vocab_size, len(tokenizer))
        # The trainer's loader and prefetcher: the ranks of a cp group read the same rows, which the step slices.
        loader = build_dataloader(
            config, tokenizer, topology.dp_rank, topology.dp_degree, device_type=device.type
        )
        data = DevicePrefetcher(loader, device if topology.cp_group is None else None, ahead=1)
        iter(data)
    model = build_model_parts(margs, topology, config)
    result = Result(name, model.nparams, seq_len, batch, mode, activations, optimizer)
    train_step = build_train_step(model, topology, config)
    # The ranks of a cp group draw the same rows (seeded by their data-parallel rank); the step slices them.
    generator = torch.Generator(device=device).manual_seed(topology.dp_rank)
    tokens = torch.randint(0, margs.vocab_size, (batch, seq_len + 1), device=device, generator=generator)
    random_batches = [({"input": tokens[:, :-1]}, tokens[:, 1:])]
    flops_per_token = model.flops_per_token
    local_tokens = batch * seq_len // args.cp  # this GPU's tokens per step

    # The trainer's garbage collection (torchtitan's: none automatic, one every training.gc_freq steps). An
    # automatic collection stalls its rank's host mid-step, and under FSDP every other rank waits for that rank.
    collector = GarbageCollection(gc_freq=config.training.gc_freq)
    steps_begun = itertools.count(1)

    def step():
        collector.run(next(steps_begun))
        if data is None:
            train_step(random_batches)
        else:  # as the trainer does: this step's batch, then the next one's while this one runs
            train_step([next(data)])
            data.prefetch()

    def warmed_up():
        if data is not None:
            data.wait_seconds = 0.0

    measure(result, step, local_tokens, flops_per_token, args, device, warmed_up)
    result.host_gib = host_peak_gib(model.parts)
    if mode == "compiled":
        result.graph_breaks = sum(counters["graph_break"].values())
    if data is not None:
        result.data_wait = data.wait_seconds / (result.step_s * args.steps)
    if args.profile:
        result.profile, timeline = profile_steps(step, args.profile, device)
        result.timelines = (timeline,)
        if dist.is_initialized() and not args.fake_world:
            timelines = [None] * world_size
            dist.all_gather_object(timelines, timeline)
            result.timelines = tuple(timelines)
    return result


def measure(
    result: Result, step, tokens: int, flops_per_token: int, args, device, warmed_up=lambda: None
) -> None:
    """Time ``args.steps`` steps after ``args.warmup`` untimed ones; fill the result's time, throughput and peak."""
    for _ in range(args.warmup):
        step()
    device_synchronize(device)
    warmed_up()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    device_synchronize(device)
    result.step_s = (time.perf_counter() - start) / args.steps
    result.host_s = host_seconds(step, device)
    result.tokens_per_s = tokens / result.step_s
    result.tflops = flops_per_token * result.tokens_per_s / 1e12
    if args.peak_tflops:
        result.mfu = result.tflops / args.peak_tflops
    if device.type == "cuda":
        result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30


HOST_STEPS = 3  # untimed steps after the timed ones, each issued to an idle GPU: the "host s" column


def host_seconds(step, device, repeats: int = HOST_STEPS) -> float:
    """The median time the host takes to issue ``step`` when its GPU has nothing queued: the step's host work
    (Python, hooks, kernel launches) without the wait for earlier kernels."""
    times = []
    for _ in range(repeats):
        device_synchronize(device)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    device_synchronize(device)
    return statistics.median(times)


NAIVE = "naive HF loop"


def run_naive_hf_loop(name: str, seq_len: int, args, device, margs=None) -> Result:
    """The anchor: the same model, shape and tokens in the loop a user writes without flame, over the class of its
    HF export (transformers' Llama for the transformer, FLA's class for GatedDeltaNet and the hybrid, flame's own
    HF class for the softpick family, the class itself for a generic-family model): eager, bf16 autocast on a GPU,
    AdamW (fused on a GPU), the class's own loss from ``labels``. ``margs``: any model's args (default: the bench
    model ``name``'s). One GPU only."""
    import flame.hf
    from flame.hf.formats import export_adapter
    from flame.models import build_model
    from flame.models.generic.args import fla_model_types
    from flame.models.generic.model import fla_classes_as_flame_builds_them
    from flame.train.kernels import prepare_gpu_kernels

    margs = model_args(name, args.tiny, args.num_layers) if margs is None else margs
    hf_config = export_adapter(margs, "auto")[0].hf_config()
    flame.hf.register()
    building = contextlib.nullcontext()
    if hf_config["model_type"] in fla_model_types():
        import fla.models  # noqa: F401  (FLA's classes)

        # FLA's class with the layers flame trains it with where FLA's need flash-attn or mamba_ssm: the same model.
        building = fla_classes_as_flame_builds_them()
    if device.type == "cuda" and importlib.util.find_spec("fla") is not None:
        # FLA's kernels as the trainer prepares them (flame.compat: FLA's gated backward on Hopper, its TileLang
        # attention's head widths), for FLA's classes and for transformers' classes that call FLA's kernels where
        # FLA is installed (qwen3_next, olmo_hybrid); Triton's autotuning seeded with flame's shipped results.
        prepare_gpu_kernels(device)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**hf_config)
    torch.manual_seed(0)
    with building:
        model = AutoModelForCausalLM.from_config(config).to(device).train()
    with torch.device("meta"):
        _, flops_per_token = margs.get_nparams_and_flops(build_model(margs), seq_len)
    batch = rows_per_step(args, seq_len)
    result = Result(name, sum(p.numel() for p in model.parameters()), seq_len, batch, NAIVE, "none", "AdamW")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, margs.vocab_size, (batch, seq_len), device=device, generator=generator)

    def step():
        # The trainer's profiler regions (STEP_REGIONS), so that --profile compares the host's phases side by side.
        with torch.profiler.record_function("flame.forward_backward"):
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
        with torch.profiler.record_function("flame.optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    measure(result, step, batch * seq_len, flops_per_token, args, device)
    if args.profile:
        result.profile, timeline = profile_steps(step, args.profile, device)
        result.timelines = (timeline,)
    return result


def profile_steps(step, steps: int, device) -> tuple[str, str]:
    """The kernels that take the time over `steps` more steps: torch.profiler's table, top 25 by device time (on a
    GPU, then the top 15 by host time: what the host spends a host-bound step on), and the step's timeline summary
    (gpu_timeline, host_phases)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    text = averages.table(sort_by=sort_by, row_limit=25, max_name_column_width=70)
    if device.type == "cuda":
        text += "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70)
    events = prof.events()
    return text, f"{gpu_timeline(events, steps)}; {host_phases(events, steps)}"


def host_phases(events, steps: int) -> str:
    """The host's time per step in each phase of the training step (flame.train.step.STEP_REGIONS), as profiled:
    the profiler's own overhead included, so an upper bound."""
    phases = {name: 0.0 for name in STEP_REGIONS}
    for event in events:
        if event.name in phases and event.device_type == DeviceType.CPU:
            phases[event.name] += event.time_range.end - event.time_range.start
    return "host per step (profiled): " + ", ".join(
        f"{name.removeprefix('flame.')} {us / 1e3 / steps:.1f} ms" for name, us in phases.items()
    )


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def gpu_timeline(events, steps: int) -> str:
    """Where a step's GPU time goes, from the kernels' start/end times (microseconds; profiler annotations left
    out): the span from the first kernel to the last, the time some compute kernel runs, the time some NCCL kernel
    runs and how much of it no compute kernel overlaps (communication the step waits for, or that slows compute
    sharing the GPU), and the time nothing runs (the GPU waiting for the host)."""
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    if not kernels:
        return "no GPU kernels recorded"
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    comm = merged([span for span, e in zip(spans, kernels) if "nccl" in e.name.lower()])
    compute = merged([span for span, e in zip(spans, kernels) if "nccl" not in e.name.lower()])
    busy = covered(merged(comm + compute))
    exposed_comm = busy - covered(compute)
    window = max(end for _, end in spans) - min(start for start, _ in spans)
    ms = 1e3 * steps
    return (
        f"GPU timeline per step: {window / ms:.1f} ms from first to last kernel; compute kernels running "
        f"{covered(compute) / ms:.1f} ms; NCCL kernels running {covered(comm) / ms:.1f} ms, "
        f"{exposed_comm / ms:.1f} ms of it with no compute kernel running; idle {(window - busy) / ms:.1f} ms"
    )


def cleanup(device) -> None:
    gc.collect()
    gc.enable()  # each flame case turns automatic collection off as the trainer does; the naive HF loop keeps it
    torch._dynamo.reset()
    counters.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    found = (
        re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else None
    )
    return found.group(1).strip() if found else "CPU"


def device_slug(name: str) -> str:
    """A device's name as a doc marker's suffix: "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def millions(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n:,}"


def table(results: list[Result], world_size: int, cp: int = 1) -> str:
    """Markdown rows; with context parallelism the GPUs column names the cp degree and batch/GPU counts rows of
    which each GPU holds a 1/cp slice."""
    gpus = f"{world_size} (cp {cp})" if cp > 1 else str(world_size)
    lines = [
        "| model | params | GPUs | seq | batch/GPU | mode | activations | optimizer | step s | host s "
        "| tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | data wait | vs naive HF loop | graph breaks |",
        "|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    anchors = {(r.model, r.seq_len): r.tokens_per_s for r in results if r.mode == NAIVE and not r.error}
    for r in results:
        if r.error:
            lines.append(f"| {r.model} | {millions(r.params)} | {gpus} | {r.seq_len} | {r.batch} | {r.mode} | "
                         f"{r.activations} | {r.optimizer} | failed: {r.error} | | | | | | | | |")  # fmt: skip
            continue
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu == r.mfu else "n/a"
        peak = f"{r.peak_gib:.1f}" if r.peak_gib == r.peak_gib else "n/a"
        if r.host_gib is not None:
            peak += f" (host {r.host_gib:.1f})"
        wait = f"{100 * r.data_wait:.2f}%" if r.data_wait == r.data_wait else "random tokens"
        anchor = anchors.get((r.model, r.seq_len))
        ratio = f"{r.tokens_per_s / anchor:.2f}x" if anchor else "n/a"
        lines.append(
            f"| {r.model} | {millions(r.params)} | {gpus} | {r.seq_len} | {r.batch} | {r.mode} | "
            f"{r.activations} | {r.optimizer} | {r.step_s:.3f} | {r.host_s:.3f} | {r.tokens_per_s:,.0f} | "
            f"{r.tflops:.1f} | {mfu} | "
            f"{peak} | {wait} | {ratio} | {'' if r.graph_breaks is None else r.graph_breaks} |"
        )
    return "\n".join(lines)


def link_bandwidth(
    device: torch.device, world_size: int, mib: int = 64, repeats: int = 5
) -> dict[str, float]:
    """Bus bandwidth in GB/s (nccl-tests' definition: the bytes a rank's link carries, size x (n-1)/n, over the
    time) of the two collectives FSDP runs every step, an all-gather of bf16 parameters and a reduce-scatter of
    fp32 gradients, ``mib`` MiB gathered per call; the slowest rank's time. It tells a slow link (PCIe, host
    memory) from ranks that wait for one another."""
    # Renamed after torch 2.11; the old names warn on newer torch.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    bandwidth = {}
    for name, dtype in (("all-gather", torch.bfloat16), ("reduce-scatter", torch.float32)):
        numel = mib * 2**20 // dtype.itemsize // world_size * world_size
        full = torch.ones(numel, dtype=dtype, device=device)
        shard = torch.ones(numel // world_size, dtype=dtype, device=device)
        collective = (
            functools.partial(gather, full, shard)
            if name == "all-gather"
            else functools.partial(scatter, shard, full)
        )
        collective()  # the first call sets up the connections
        dist.barrier()
        device_synchronize(device)
        began = time.perf_counter()
        for _ in range(repeats):
            collective()
        device_synchronize(device)
        seconds = torch.tensor((time.perf_counter() - began) / repeats, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        bandwidth[name] = numel * dtype.itemsize * (world_size - 1) / world_size / seconds.item() / 1e9
    return bandwidth


def device_synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(
    path: Path, results: list[Result], world_size: int, device: torch.device, link: dict[str, float] | None
) -> None:
    record = {"world_size": world_size, "device": device_name(device), "torch": torch.__version__,
              "link_bus_GBps": link, "results": [dataclasses.asdict(r) for r in results]}  # fmt: skip
    path.write_text(json.dumps(record, indent=1))


def command_line(script: str, argv: list | None, launcher: tuple[str, ...] = ("python",)) -> str:
    """The command that ran ``script`` (its arguments: ``argv``, or the process's), quoted so it runs as printed."""
    return shlex.join([*launcher, script, *map(str, sys.argv[1:] if argv is None else argv)])


def write_section(doc: Path, marker: str, title: str, description: str, table_text: str) -> None:
    """Puts "## title", the description and the table between <!-- marker --> and <!-- /marker --> in doc (the
    previous run's section there is replaced); every bench script writes its results this way."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    section = "\n".join([start, f"## {title}", "", description, "", table_text, end])
    text = doc.read_text() if doc.exists() else "# Performance\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    text = (
        pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    )
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text.rstrip("\n") + "\n")
    print(f"\nwrote the {marker} section of {doc}")


def section_in(text: str, marker: str) -> str:
    """The text between ``marker``'s comments in a doc's ``text`` ("" where there is none): the section a bench
    script wrote there last, for the scripts that merge their rows into it."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    return text.split(start, 1)[1].split(end, 1)[0] if start in text and end in text else ""


def data_description(args) -> str:
    if args.data == "random":
        return "random tokens"
    workers = "the trainer's choice of" if args.num_workers is None else str(args.num_workers)
    return (
        f"batches of {Path(args.dataset).name} (tokenizer {Path(args.tokenizer).name}) through flame's dataloader "
        f"({workers} workers) and device prefetcher"
    )


def add_doc_options(parser: argparse.ArgumentParser) -> None:
    """--doc and --no_write: the markdown file a bench script writes its section into, or print only."""
    parser.add_argument(
        "--doc", type=Path, default=PERFORMANCE_DOC, help="markdown file to write the table into"
    )
    parser.add_argument("--no_write", action="store_true", help="print only")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options every training bench takes: --device, --tiny, --doc, --no_write."""
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    parser.add_argument("--tiny", action="store_true", help="tiny versions of the models (smoke test)")
    add_doc_options(parser)


def no_cuda_gpu(script: str) -> bool:
    """Whether no CUDA GPU is visible, saying so for a kernel bench ``script`` (its kernels are Triton)."""
    if torch.cuda.is_available():
        return False
    print(f"{script} needs a CUDA GPU (the kernels are Triton); none is visible", file=sys.stderr)
    return True


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma separated: " + ", ".join(MODELS) + ", or a --model.config file (a path ending in .json)",
    )
    parser.add_argument("--seq_lens", default=None, help="comma separated (default 2048,4096; --tiny: 64)")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    parser.add_argument(
        "--tokens_per_gpu", type=int, default=None, help="per step (default 16384; --tiny: 128)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny: 2)")
    parser.add_argument(
        "--compile_backend", default="inductor", help="torch.compile backend of the compiled mode"
    )
    parser.add_argument(
        "--compile_components",
        default="model,loss",
        help="what the compiled mode compiles: model, loss or both",
    )
    parser.add_argument(
        "--attention_backend", default="auto", choices=ATTENTION_BACKENDS, help="GPU attention kernels"
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each row is split over this many ranks (the rest of the world size is "
        "data parallel)",
    )
    parser.add_argument(
        "--fsdp_reshard_after_forward",
        choices=("default", "always", "never"),
        default="default",
        help="FSDP: free each block's gathered parameters after its forward (never: keep them for the backward, "
        "one all-gather per block and step instead of two)",
    )
    parser.add_argument(
        "--activations",
        default="none",
        help="comma separated, what the blocks keep for backward: none, full or selective (activation "
        "checkpointing), offload (to pinned host memory), full+offload",
    )
    parser.add_argument("--optimizers", default="AdamW", help="comma separated: AdamW, Muon")
    parser.add_argument(
        "--job_flags", default="", help="train.sh flags added to every case's job, one string (shell quoting)"
    )
    parser.add_argument(
        "--data",
        choices=("random", "real"),
        default="random",
        help="random tokens on the device, or batches through flame's dataloader and device prefetcher",
    )
    parser.add_argument(
        "--dataset", default=str(DEFAULT_DATASET), help="--data real: the dataset (training.dataset)"
    )
    parser.add_argument(
        "--tokenizer",
        default=str(DEFAULT_TOKENIZER),
        help="--data real: the tokenizer (model.tokenizer_path)",
    )
    parser.add_argument(
        "--num_workers",
        type=int,
        default=None,
        help="--data real: dataloader workers per rank (default: the trainer's choice for the device)",
    )
    parser.add_argument(
        "--anchor",
        action="store_true",
        help="also time each model and length in the naive HF training loop (one GPU); rows show the ratio",
    )
    parser.add_argument("--quick", action="store_true", help="seq 2048 only, 2 warm-up + 5 timed steps")
    add_run_options(parser)
    parser.add_argument(
        "--num_layers", type=int, default=None, help="blocks per model (default: its config's)"
    )
    parser.add_argument(
        "--data_parallel",
        choices=("fsdp", "ddp"),
        default="fsdp",
        help="how several ranks split the model: FSDP per block, or DDP (replicated parameters, gradients "
        "all-reduced in buckets)",
    )
    parser.add_argument(
        "--fake_world",
        type=int,
        default=0,
        help="one process as rank 0 of a world of this size whose collectives do nothing (data parallelism's host cost "
        "without communication, on any machine); prints only",
    )
    parser.add_argument("--peak_tflops", type=float, default=None, help="default: 989 on CUDA, none on CPU")
    parser.add_argument(
        "--json", type=Path, default=None, help="rank 0 writes the results here, after every case"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="profile this many more steps per case; print the top kernels and the GPU timeline",
    )
    args = parser.parse_args(argv)
    defaults = {"seq_lens": "64", "tokens_per_gpu": 128, "warmup": 1, "steps": 2} if args.tiny else {
        "seq_lens": "2048,4096", "tokens_per_gpu": 16384, "warmup": 3, "steps": 10}  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.seq_lens, args.warmup, args.steps = (
            args.seq_lens.split(",")[0],
            min(args.warmup, 2),
            min(args.steps, 5),
        )
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = H100_BF16_PEAK_TFLOPS
    for name in args.models.split(","):
        if name.endswith(".json"):
            if args.tiny:
                parser.error(f"--tiny takes the bench's own models, not a config file ({name})")
            if not (REPO / name).is_file():
                parser.error(f"model config {name} does not exist")
        elif name not in MODELS:
            parser.error(
                f"unknown model {name}; choose from {', '.join(MODELS)} or give a config file (.json)"
            )
    for activations in args.activations.split(","):
        if activations not in ACTIVATIONS:
            parser.error(f"unknown --activations {activations}; choose from {', '.join(ACTIVATIONS)}")
    for optimizer in args.optimizers.split(","):
        if optimizer not in ("AdamW", "Muon"):
            parser.error(f"unknown --optimizers {optimizer}; choose from AdamW, Muon")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from torchtitan.distributed import ParallelDims

    world_size = args.fake_world or int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0 if args.fake_world else int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.fake_world:
        # One process stands for every rank, its collectives doing nothing: what is left of FSDP is its host work.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    elif world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    compat.apply()
    # Each block of each model compiles separately; keep dynamo from falling back to eager after many graphs.
    for name, value in (
        ("recompile_limit", 256),
        ("cache_size_limit", 256),
        ("accumulated_recompile_limit", 4096),
    ):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    if world_size % args.cp:
        print(f"error: --cp {args.cp} does not divide the {world_size} processes", file=sys.stderr)
        return 2
    data_parallel = world_size // args.cp
    ddp = args.data_parallel == "ddp" and data_parallel > 1
    parallel_dims = ParallelDims(
        dp_replicate=data_parallel if ddp else 1,
        dp_shard=1 if ddp else data_parallel,
        cp=args.cp,
        tp=1,
        pp=1,
        ep=1,
        etp=1,
        world_size=world_size,
    )
    if world_size > 1:
        parallel_dims.build_mesh()

    link = link_bandwidth(device, world_size) if world_size > 1 and not args.fake_world else None
    if rank == 0 and link:
        print("link bus bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in link.items()), flush=True)
    results = []
    started = time.perf_counter()
    for name in args.models.split(","):
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            cases = list(
                itertools.product(
                    args.modes.split(","), args.activations.split(","), args.optimizers.split(",")
                )
            )
            if args.anchor:
                cases.insert(0, (NAIVE, "none", "AdamW"))
            for mode, activations, optimizer in cases:
                case_start = time.perf_counter()
                try:
                    if mode == NAIVE:
                        result = run_naive_hf_loop(name, seq_len, args, device)
                    else:
                        result = run_case(
                            name, seq_len, mode, activations, optimizer, args, device, parallel_dims
                        )
                except Exception as e:  # e.g. out of memory: report it and go on
                    if rank == 0:
                        traceback.print_exc()
                    message = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
                    result = Result(
                        name,
                        0,
                        seq_len,
                        rows_per_step(args, seq_len),
                        mode,
                        activations,
                        optimizer,
                        error=message,
                    )
                cleanup(device)
                results.append(result)
                if rank == 0:
                    print(table([result], world_size, args.cp).splitlines()[-1], f"({time.perf_counter() - case_start:.0f} s)",
                          flush=True)  # fmt: skip
                    if args.json:
                        write_json(args.json, results, world_size, device, link)
                    if result.profile:
                        timelines = "\n".join(f"rank {r}: {line}" for r, line in enumerate(result.timelines))
                        print(
                            f"profile of {name} seq {seq_len} {mode} {activations} {optimizer}:\n"
                            f"{result.profile}\n{timelines}",
                            flush=True,
                        )
    if rank == 0:
        text = table(results, world_size, args.cp)
        print("\n" + text)
        if args.fake_world:
            print(
                f"(a fake process group of {world_size}: {args.data_parallel.upper()}'s host work without "
                "communication; not written)"
            )
        elif not args.no_write:
            # Runs over activation modes or optimizers get their own section beside the plain throughput table.
            memory_study = args.activations != "none" or args.optimizers != "AdamW"
            long_context = max(int(s) for s in args.seq_lens.split(",")) > LONG_CONTEXT
            marker = (
                f"bench_train_throughput_{world_size}gpu"
                + (f"_cp{args.cp}" if args.cp > 1 else "")
                + ("_real_data" if args.data == "real" else "")
                + ("_memory" if memory_study else "")
                + ("_anchor" if args.anchor else "")
                + ("_long_context" if long_context else "")
            )
            launcher = ("torchrun", "--nproc_per_node", str(world_size)) if world_size > 1 else ("python",)
            command = command_line("bench/train_throughput.py", argv, launcher)
            if device.type == "cpu":
                parallelism = "float32" + (", FSDP" if world_size > 1 else "")
            else:
                parallelism = (
                    "FSDP (bf16 params, fp32 reduce)" if world_size > 1 else "one GPU, bf16 autocast"
                )
            if args.cp > 1:
                parallelism += (
                    f" over data parallel {world_size // args.cp} x context parallel {args.cp} (each row split "
                    f"over {args.cp} ranks; batch/GPU counts rows)"
                )
            write_section(
                args.doc,
                marker,
                f"Training throughput{' beside the naive HF loop' if args.anchor else ''}, {world_size} {device.type.upper()}{'s' * (world_size > 1)}"
                + (f", context parallel {args.cp}" if args.cp > 1 else "")
                + (", flame's data path" if args.data == "real" else "")
                + (", long context" if long_context else "")
                + (": activation memory and optimizers" if memory_study else ""),
                f"Command: `{command}` on {world_size} x {device_name(device)}, torch {torch.__version__} "
                f"({time.strftime('%Y-%m-%d')}); {parallelism}, {data_description(args)}, "
                f"{args.tokens_per_gpu:,} tokens per GPU per step, {args.warmup} warm-up then "
                f"{args.steps} timed steps. MFU against {args.peak_tflops or 'n/a'} TFLOP/s; FLOPs per token "
                "from get_nparams_and_flops. Total run time "
                f"{time.perf_counter() - started:.0f} s.",
                text,
            )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
