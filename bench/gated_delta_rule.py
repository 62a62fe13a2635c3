"""The gated delta rule (Gated DeltaNet's op), forward + backward, on every implementation there is, in one run.

    python bench/gated_delta_rule.py                                   # the three head shapes below, 8 x 2048, bf16
    python bench/gated_delta_rule.py --shapes 16x128x128 --batch 8 --seq_len 2048
    python bench/gated_delta_rule.py --variants flame --shapes 6x256x512 --kernels 12 --no_write   # where time goes
    python bench/gated_delta_rule.py --device cpu --tiny               # smoke test: the PyTorch implementation

Shapes are heads x K x V: 16x128x128 (Qwen3-Next-like heads), 6x256x512 (configs/gated_deltanet_340M.json) and
16x96x192 (configs/olmo_1b_*.json). The call is a Gated DeltaNet layer's: q, k [B, T, H, K] with the l2 norm in the
kernel, v [B, T, H, V], log-decay g and beta [B, T, H], bf16 (g float32), no initial state, states stored value-first
(``state_v_first``, as FLA's layer asks). On a GPU flame's variants call the op compiled (``torch.compile``, one
graph), as a compiled block does, so that their backward is the one the speed table's compiled rows run (flame's
custom ops, flame/ops/fla_library.py); FLA's variants call FLA's op as FLA's own layer does, eagerly.

Each variant runs in a process of its own, because FLA reads its backend switches (``FLA_TILELANG``,
``FLA_FLASH_QLA``) from the environment, and so that no variant's autotuning or compilation shares a GPU with
another's timing:

- ``flame``: flame's dispatch (flame/ops/dispatch.py) as a training job meets the call: the first backend that is
  installed and takes it (the table says which served), with FLA's backend switches unset, so that flame's ``fla``
  backend is FLA's op as FLA configures itself (on Hopper its gated dq/dk/dw/dg is FLA's TileLang kernel where
  tilelang and nvcc are installed, else flame's Triton kernel);
- ``flame-save``: the same with the forward keeping the state recurrence's results for the backward instead of
  the backward recomputing them (``--activation_checkpoint.chunk_states save``); calls that FlashQLA serves keep no
  states either way;
- ``flame-triton``: ``flame`` with FLA's TileLang backend off, so that on Hopper flame's Triton kernel serves the
  gated dq/dk/dw/dg (the two kernels side by side);
- ``fla+tilelang``, ``fla+flash-qla``: FLA 0.6.0's ``chunk_gated_delta_rule`` with that backend of FLA's switched
  on (it falls back to FLA's Triton kernels for calls the backend refuses);
- ``fla``: FLA's op with its backends off: FLA's Triton kernels alone (which refuse the gated backward on Hopper
  with Triton 3.4-3.7.0: FLA issue 640).

Each call is timed after one untimed call, which autotunes and compiles. On a GPU a cell gives the kernels' time
per call first (the sum of the CUDA kernels' durations over five calls, from torch.profiler), then the wall time (the
median of ``triton.testing.do_bench``). The variants are ranked by the first: at 8 x 2048 an eager call's Python and
kernel launches take about as long as its kernels (docs/performance.md, "Gated delta rule, every implementation"),
so the wall time measures the host as much as the kernels; a training step that compiles its blocks or replays
them as CUDA graphs does not pay it. The
error is the largest of max|x - ref| / max|ref| over the output and the gradients of q, k, v, g and beta, against
flame's PyTorch implementation in float32 (float64 on the CPU) on the same inputs. ``--kernels N`` adds a table of
each cell's N longest kernels per call, which says what bounds each variant. The tables go into
docs/performance.md between ``<!-- bench_gated_delta_rule_<device> -->`` markers (one section per device) with the
command, device and date.
"""

import argparse
import functools
import json
import os
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

from train_throughput import (  # noqa: E402
    add_doc_options,
    command_line,
    device_name,
    device_slug,
    device_synchronize,
    write_section,
)

MARKER = "bench_gated_delta_rule"  # one section per device: bench_gated_delta_rule_<device>
SHAPES = "16x128x128,6x256x512,16x96x192"
# FLA's backend switches per variant (None: unset, FLA's default, as in a training job).
VARIANTS = {
    "flame": {"FLA_TILELANG": None, "FLA_FLASH_QLA": None},
    "flame-save": {"FLA_TILELANG": None, "FLA_FLASH_QLA": None},
    "flame-triton": {"FLA_TILELANG": "0", "FLA_FLASH_QLA": None},
    "fla+tilelang": {"FLA_TILELANG": "1", "FLA_FLASH_QLA": "0"},
    "fla+flash-qla": {"FLA_TILELANG": "0", "FLA_FLASH_QLA": "1"},
    "fla": {"FLA_TILELANG": "0", "FLA_FLASH_QLA": "0"},
}
GRADIENTS = ("q", "k", "v", "g", "beta")


def inputs(shape: str, batch: int, seq_len: int, device: torch.device, dtype: torch.dtype) -> dict:
    heads, k_dim, v_dim = (int(n) for n in shape.split("x"))
    generator = torch.Generator(device="cpu").manual_seed(0)

    def draw(*size):
        return torch.randn(*size, generator=generator)

    tensors = {
        "q": draw(batch, seq_len, heads, k_dim),
        "k": draw(batch, seq_len, heads, k_dim),
        "v": draw(batch, seq_len, heads, v_dim),
        # A log decay per token as Gated DeltaNet's gate makes it: negative, mostly small.
        "g": torch.nn.functional.logsigmoid(draw(batch, seq_len, heads) + 3.0),
        "beta": torch.sigmoid(draw(batch, seq_len, heads)),
        "do": draw(batch, seq_len, heads, v_dim),
    }
    return {
        name: t.to(device=device, dtype=torch.float32 if name == "g" and dtype != torch.float64 else dtype)
        for name, t in tensors.items()
    }


def forward_backward(op, tensors: dict) -> dict:
    """One call and its backward; the output and the gradients."""
    leaves = {name: tensors[name].detach().requires_grad_() for name in GRADIENTS}
    o, _ = op(**leaves, use_qk_l2norm_in_kernel=True, state_v_first=True)
    o.backward(tensors["do"])
    return {"o": o.detach(), **{name: leaf.grad for name, leaf in leaves.items()}}


def relative_error(results: dict, reference: dict) -> tuple[float, str]:
    errors = {
        name: (
            (results[name].double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)
        ).item()
        for name, ref in reference.items()
    }
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def variant_op(variant: str, device: torch.device):
    """The op this variant calls, and a function of the inputs naming what serves them."""
    if variant.startswith("flame"):
        from flame.ops.fla_library import set_chunk_states
        from flame.ops.gated_delta_rule import GATED_DELTA_RULE, chunk_gated_delta_rule

        if variant == "flame-save":
            set_chunk_states("save")
        if device.type == "cuda":  # as a training job: flame's shipped tuning results, its Hopper dq/dk/dw/dg
            from flame.train.kernels import prepare_gpu_kernels

            prepare_gpu_kernels(device)

        def served_by(tensors: dict) -> str:
            q, k, v, g, beta = (tensors[name] for name in GRADIENTS)
            return GATED_DELTA_RULE.choose(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True, state_v_first=True
            )[0]

        if device.type == "cuda":
            return torch.compile(chunk_gated_delta_rule, fullgraph=True, dynamic=False), served_by
        return chunk_gated_delta_rule, served_by
    if device.type != "cuda":
        raise RuntimeError("FLA's kernels need a CUDA device")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule, lambda tensors: variant


def time_ms(fn, device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=max(repeats, 20))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def kernel_times(fn, calls: int = 5) -> dict[str, float]:
    """The GPU's time per call of ``fn`` in each CUDA kernel (ms, the longest first), from ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel = {
        event.key: event.self_device_time_total / calls / 1e3
        for event in profiler.key_averages()
        if event.self_device_time_total > 0
    }
    return dict(sorted(per_kernel.items(), key=lambda item: -item[1]))


def measure_variant(args: argparse.Namespace) -> list[dict]:
    """This process's variant over every shape (the child's work). Each shape's row is printed and written to
    ``args.json`` as soon as it is measured, so that a variant stopped by its time limit keeps the shapes it
    finished."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reference_dtype = torch.float32 if device.type == "cuda" else torch.float64
    from flame.ops.gated_delta_rule import pytorch_chunk_gated_delta_rule

    rows = []
    for shape in args.shapes.split(","):
        row = {"variant": args.variant, "shape": shape}
        try:
            op, served_by = variant_op(args.variant, device)
            tensors = inputs(shape, args.batch, args.seq_len, device, dtype)
            row["served_by"] = served_by(tensors)
            began = time.perf_counter()
            results = forward_backward(op, tensors)  # autotunes and compiles
            device_synchronize(device)
            row["first_call_s"] = round(time.perf_counter() - began, 1)
            upcast = {
                name: t.to(torch.promote_types(t.dtype, reference_dtype)) for name, t in tensors.items()
            }
            reference = forward_backward(pytorch_chunk_gated_delta_rule, upcast)
            row["error"], row["worst"] = relative_error(results, reference)
            del reference
            call = functools.partial(forward_backward, op, tensors)
            row["ms"] = time_ms(call, device, args.repeats)
            if device.type == "cuda":
                row["kernels"] = kernel_times(call)
                row["kernel_ms"] = sum(row["kernels"].values())
        except Exception as error:  # a backend that refuses or fails: its row says so, the others still run
            row["failed"] = (
                f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
            )
        rows.append(row)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_variant(variant: str, args: argparse.Namespace, work: Path) -> list[dict]:
    out = work / f"{variant}.json"
    command = [sys.executable, __file__, "--variant", variant, "--json", str(out), "--device", args.device,
               "--shapes", args.shapes, "--batch", str(args.batch), "--seq_len", str(args.seq_len),
               "--repeats", str(args.repeats)]  # fmt: skip
    env = {name: value for name, value in {**os.environ, **VARIANTS[variant]}.items() if value is not None}
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    print(f"== {variant}", flush=True)
    try:
        status = subprocess.run(command, env=env, timeout=args.timeout_s, cwd=REPO).returncode
        ending = None if status == 0 else f"exit status {status}"
    except subprocess.TimeoutExpired:
        ending = f"no result within {args.timeout_s:.0f} s"
    rows = json.loads(out.read_text()) if out.is_file() else []
    done = {row["shape"] for row in rows}
    return rows + [{"variant": variant, "shape": s, "failed": ending or "no result"} for s in args.shapes.split(",")
                   if s not in done]  # fmt: skip


def table(rows: list[dict], shapes: list[str], variants: list[str]) -> str:
    lines = ["| heads x K x V | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for shape in shapes:
        cells = []
        for variant in variants:
            row = next(r for r in rows if r["variant"] == variant and r["shape"] == shape)
            if "failed" in row:
                cells.append(f"failed: {row['failed']}")
                continue
            served = f", {row['served_by']}" if row["served_by"] != variant else ""
            tensor = "o" if row["worst"] == "o" else f"d{row['worst']}"
            wall = f"{row['ms']:.2f} wall; " if "kernel_ms" in row else ""
            cells.append(
                f"{row.get('kernel_ms', row['ms']):.2f} ms ({wall}{row['error']:.1e} in {tensor}{served})"
            )
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_table(rows: list[dict], top: int) -> str:
    """Each measured row's ``top`` longest kernels per call, and what the rest of its kernels take together."""
    lines = ["| heads x K x V | variant | kernel | ms per call | share |", "|---|---|---|---:|---:|"]
    for row in rows:
        if "kernels" not in row:
            continue
        kernels = list(row["kernels"].items())
        shown = kernels[:top]
        if rest := kernels[top:]:
            shown.append((f"{len(rest)} others", sum(ms for _, ms in rest)))
        for name, ms in shown:
            lines.append(
                f"| {row['shape']} | {row['variant']} | {name[:90]} | {ms:.3f} | {ms / row['kernel_ms']:.0%} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    parser.add_argument(
        "--shapes", default=None, help=f"comma separated HxKxV (default {SHAPES}; --tiny: 3x16x24)"
    )
    parser.add_argument("--batch", type=int, default=None, help="default 8 (--tiny: 2)")
    parser.add_argument("--seq_len", type=int, default=None, help="default 2048 (--tiny: 45)")
    parser.add_argument(
        "--variants", default=None, help=f"comma separated of {', '.join(VARIANTS)} (CPU: flame)"
    )
    parser.add_argument(
        "--repeats", type=int, default=20, help="timed calls on the CPU (the GPU's do_bench chooses)"
    )
    parser.add_argument(
        "--timeout_s", type=float, default=600, help="per variant, compilation and tuning included"
    )
    parser.add_argument("--tiny", action="store_true", help="small shapes (smoke test)")
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="on a GPU, also tabulate each cell's N longest kernels per call",
    )
    add_doc_options(parser)
    parser.add_argument(
        "--variant", choices=list(VARIANTS), help=argparse.SUPPRESS
    )  # a child process's variant
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.shapes = args.shapes or ("3x16x24" if args.tiny else SHAPES)
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq_len = args.seq_len or (45 if args.tiny else 2048)
    args.variants = args.variants or (",".join(VARIANTS) if args.device == "cuda" else "flame")
    if unknown := set(args.variants.split(",")) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.variant:
        measure_variant(args)
        return 0
    started = time.perf_counter()
    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory() as work:
        rows = [row for variant in variants for row in run_variant(variant, args, Path(work))]
    text = table(rows, args.shapes.split(","), variants)
    first_calls = "; ".join(
        f"{r['variant']} {r['shape']} {r['first_call_s']} s" for r in rows if "first_call_s" in r
    )
    text += f"\n\nFirst call (autotuning and compilation): {first_calls}."
    if args.kernels and (kernels := kernel_table(rows, args.kernels)):
        text += f"\n\nEach cell's {args.kernels} longest kernels per call (torch.profiler, five calls):\n\n{kernels}"
    print("\n" + text)
    if not args.no_write:
        command = command_line("bench/gated_delta_rule.py", argv)
        dtype = "bf16 (g float32)" if args.device == "cuda" else "float32"
        timing = (
            "the kernels' time per call (the variants' ranking), then the median wall time of back-to-back calls"
            if args.device == "cuda"
            else "the median time"
        )
        device = device_name(torch.device(args.device))
        write_section(
            args.doc,
            f"{MARKER}_{device_slug(device)}",
            f"Gated delta rule, every implementation, {device}",
            f"Command: `{command.strip()}` on {device}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}); {args.batch} x {args.seq_len} tokens, {dtype}, forward + backward, "
            f"the l2 norm of q and k in the kernel. Each cell: {timing}, and the largest relative error over "
            "o and the gradients against flame's PyTorch implementation in "
            f"{'float32' if args.device == 'cuda' else 'float64'} (which tensor; what served the call where a "
            f"variant's dispatch chose). Total {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0 if all("failed" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
