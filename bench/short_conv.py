"""Speed of flame's Triton short convolution against FLA 0.6.0's causal_conv1d, and the memory-bandwidth floor.

    python bench/short_conv.py [--dims 1536,3072] [--batch 8] [--seq_len 2048] [--no_write]
    python bench/short_conv.py --together 1536,1536,3072 [--no_write]

Per channel count D, x [batch, seq_len, D] in bfloat16 with a bfloat16 weight [D, 4] and bias, SiLU, as the q/k/v
short convs of Gated DeltaNet run it in training (no cu_seqlens). Times are medians of
triton.testing.do_bench_cudagraph (replays of a CUDA graph: GPU time, without the Python launch overhead that
otherwise dominates an op of a few tens of microseconds) after one untimed call (compilation, autotuning);
"fwd+bwd" is the forward and torch.autograd.grad of a fixed output gradient.
The floor is the time the bytes must take at the bandwidth of a same-size `clone` (one read and one write of x):
the forward reads x and writes y (1 clone), forward + backward also read x and dy and write dx (2.5 clones);
weight, bias and their gradients are negligible. The markdown table goes into docs/performance.md between
``<!-- bench_short_conv -->`` markers.

``--together`` times a layer's convolutions (gated_deltanet_340M's q, k and v: no bias, as its layer has) as the
compiled graph calls them, through the ops flame::short_conv_fwd and flame::short_conv_bwd: one call per convolution
against one call for all (flame.ops.short_conv.short_conv_group), forward and backward. "host ms" is the median time
the host takes to issue them with the GPU idle at the start (the op's Python, the autotuner's dispatch and Triton's
launcher: what a host-bound step pays), "GPU ms" their do_bench_cudagraph median. Its table goes between
``<!-- bench_short_conv_together -->`` markers.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from train_throughput import add_doc_options, command_line, device_name, no_cuda_gpu, write_section  # noqa: E402

from flame.ops.short_conv.triton_kernel import short_conv_triton  # noqa: E402

MARKER = "bench_short_conv"
TOGETHER_MARKER = "bench_short_conv_together"
WIDTH = 4
# Bytes moved, in units of one clone of x (one read and one write).
CLONES = {"fwd": 1.0, "fwd+bwd": 2.5}


def fla_short_conv(x, weight, bias, activation, cu_seqlens):
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x=x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens)[0]


IMPLS = {"flame Triton": short_conv_triton, "FLA causal_conv1d": fla_short_conv}


def measure(batch: int, seq_len: int, dim: int, rep: int) -> list[dict]:
    """[{"impl", "fwd", "fwd+bwd"}] in ms, the floor first."""
    from triton.testing import do_bench_cudagraph

    def bench(fn):
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")

    x = torch.randn(batch, seq_len, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(dim, WIDTH, device="cuda") / WIDTH**0.5).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    clone = bench(lambda: x.detach().clone())
    rows = [{"impl": "floor (clone bandwidth)", **{mode: clones * clone for mode, clones in CLONES.items()}}]
    for impl, conv in IMPLS.items():

        def forward(conv=conv):
            with torch.no_grad():
                conv(x, weight, bias, "silu", None)

        def forward_backward(conv=conv):
            torch.autograd.grad(conv(x, weight, bias, "silu", None), (x, weight, bias), dy)

        forward_backward()  # compilation and autotuning, untimed
        rows.append({"impl": impl, "fwd": bench(forward), "fwd+bwd": bench(forward_backward)})
    return rows


def host_ms(fn, repeats: int = 21, calls: int = 10) -> float:
    """Median host milliseconds to issue ``fn`` once, the GPU idle when each batch of ``calls`` starts."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def measure_together(batch: int, seq_len: int, dims: list[int], rep: int) -> list[dict]:
    """[{"impl", "host", "gpu"}] in ms for the convolutions of ``dims`` one call each and all in one call."""
    from triton.testing import do_bench_cudagraph

    fwd, bwd = torch.ops.flame.short_conv_fwd.default, torch.ops.flame.short_conv_bwd.default
    xs = [torch.randn(batch, seq_len, dim, device="cuda", dtype=torch.bfloat16) for dim in dims]
    weights = [(torch.randn(dim, 1, WIDTH, device="cuda") / WIDTH**0.5).to(torch.bfloat16) for dim in dims]
    dys = [torch.randn_like(x) for x in xs]
    absent = [None] * 3

    def one_call_each():
        for x, weight, dy in zip(xs, weights, dys):
            fwd(x, weight, None, *absent, *absent, "silu", None)
            bwd(dy, None, None, x, weight, None, *absent, *absent, "silu", None)

    members = [t for x, weight in zip(xs, weights) for t in (x, weight, None)]
    members += absent * (3 - len(dims))
    grads = [*dys, *[None] * (3 - len(dims))]

    def one_call():
        fwd(*members, "silu", None)
        bwd(*grads, *members, "silu", None)

    rows = []
    for impl, fn in (("one call per convolution", one_call_each), ("one call for all", one_call)):
        fn()  # compilation and autotuning, untimed
        rows.append(
            {"impl": impl, "host": host_ms(fn), "gpu": do_bench_cudagraph(fn, rep=rep, return_mode="median")}
        )
    return rows


def together_table(rows: list[dict], shape: str) -> str:
    lines = [
        "| convolutions | calls | host ms | GPU ms | host / one call for all |",
        "|---|---|---:|---:|---:|",
    ]
    together = rows[-1]["host"]
    for row in rows:
        lines.append(
            f"| {shape} | {row['impl']} | {row['host']:.3f} | {row['gpu']:.3f} | {row['host'] / together:.2f}x |"
        )
    return "\n".join(lines)


def table(rows: list[dict], shape_header: str = "x [B, T, D]") -> str:
    """Rows of an op's forward and forward + backward times against the bandwidth floor (bench/selective_scan.py
    writes its table with this too)."""
    lines = [
        f"| {shape_header} | implementation | fwd ms | bwd ms | fwd+bwd ms | fwd / floor | fwd+bwd / floor |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        floor = row["floor"]
        lines.append(
            f"| {row['shape']} | {row['impl']} | {row['fwd']:.3f} | {row['fwd+bwd'] - row['fwd']:.3f} | "
            f"{row['fwd+bwd']:.3f} | {row['fwd'] / floor['fwd']:.2f} | {row['fwd+bwd'] / floor['fwd+bwd']:.2f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="1536,3072", help="comma separated channel counts D")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph repetitions, ms")
    parser.add_argument(
        "--together", help="comma separated channel counts of up to three convolutions timed as one layer's"
    )
    add_doc_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if no_cuda_gpu("bench/short_conv.py"):
        return 1
    started = time.perf_counter()
    if args.together:
        return main_together(args, argv, started)
    rows = []
    for dim in (int(d) for d in args.dims.split(",")):
        results = measure(args.batch, args.seq_len, dim, args.rep)
        shape = f"[{args.batch}, {args.seq_len}, {dim}]"
        for result in results:
            rows.append({**result, "shape": shape, "floor": results[0]})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    print("\n" + text)
    if not args.no_write:
        command = command_line("bench/short_conv.py", argv)
        write_section(
            args.doc,
            MARKER,
            "Short convolution kernel",
            f"Command: `{command}` on {device_name(torch.device('cuda'))}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}); bfloat16 x, weight [D, {WIDTH}] and bias, SiLU, no cu_seqlens. "
            "Medians of triton.testing.do_bench_cudagraph (GPU time); bwd = fwd+bwd - fwd. The floor moves "
            "the op's bytes at the bandwidth of a same-size clone (fwd: read x, write y; fwd+bwd: also read x "
            "and dy, write dx). "
            f"Total run time {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0


def main_together(args: argparse.Namespace, argv: list[str] | None, started: float) -> int:
    dims = [int(d) for d in args.together.split(",")]
    shape = " + ".join(f"[{args.batch}, {args.seq_len}, {dim}]" for dim in dims)
    text = together_table(measure_together(args.batch, args.seq_len, dims, args.rep), shape)
    print(text)
    if not args.no_write:
        command = command_line("bench/short_conv.py", argv)
        write_section(
            args.doc,
            TOGETHER_MARKER,
            "Short convolutions run together",
            f"Command: `{command}` on {device_name(torch.device('cuda'))}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}); bfloat16 x and weight [D, {WIDTH}], no bias, SiLU, no cu_seqlens; "
            "each row the forward and backward ops of every convolution, as a compiled graph calls them. "
            "host ms: median time to issue them, the GPU idle at the start; GPU ms: do_bench_cudagraph median. "
            f"Total run time {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
