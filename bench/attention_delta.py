"""Speed of flame's attention-backward delta kernel against FLA 0.6.0's, and the memory-bandwidth floor.

    python bench/attention_delta.py [--shapes 8x2048x64x64,8x2048x16x128] [--no_write]

Per shape B x T x H x V: o and do [B, T, H, V] in bfloat16, delta = rowsum(o * do) in float32, as the backward of
FLA's parallel attentions (softmax attention, NSA, PaTH) computes it; NSA's config at the family table's size has
64 query heads of 64 channels. Times are medians of triton.testing.do_bench_cudagraph (GPU time) after one untimed
call. The floor is the time of reading o and do once at the bandwidth of a same-size `clone` (one read and one
write of o: the op moves as many bytes). The markdown table goes into docs/performance.md between
``<!-- bench_attention_delta -->`` markers.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from train_throughput import add_doc_options, command_line, device_name, no_cuda_gpu, write_section  # noqa: E402

from flame.ops.attention_delta.triton_kernel import attention_delta_triton  # noqa: E402

MARKER = "bench_attention_delta"


def fla_attention_delta(o, do):
    """FLA's own function (the one flame.compat replaces, kept as __wrapped__ where the replacement is in)."""
    from fla.ops.attn import parallel

    function = parallel.parallel_attn_bwd_preprocess
    return getattr(function, "__wrapped__", function)(o, do)


IMPLS = {"flame Triton": attention_delta_triton, "FLA parallel_attn_bwd_preprocess": fla_attention_delta}


def measure(shape: tuple[int, ...], rep: int) -> list[tuple[str, float, float]]:
    """[(implementation, ms, largest difference from float64)], the floor first."""
    from triton.testing import do_bench_cudagraph

    o = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    want = (o.double() * do.double()).sum(-1)
    rows = [
        ("floor (clone bandwidth)", do_bench_cudagraph(lambda: o.clone(), rep=rep, return_mode="median"), 0.0)
    ]
    for impl, op in IMPLS.items():
        error = (op(o, do).double() - want).abs().max().item()
        rows.append((impl, do_bench_cudagraph(lambda op=op: op(o, do), rep=rep, return_mode="median"), error))
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", default="8x2048x64x64,8x2048x16x128,8x2048x12x64", help="BxTxHxV, comma separated"
    )
    parser.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph repetitions, ms")
    add_doc_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if no_cuda_gpu("bench/attention_delta.py"):
        return 1
    started = time.perf_counter()
    lines = [
        "| o, do [B, T, H, V] | implementation | ms | / floor | vs FLA | max abs error vs float64 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for text in args.shapes.split(","):
        shape = tuple(int(n) for n in text.split("x"))
        rows = measure(shape, args.rep)
        floor, fla = rows[0][1], rows[-1][1]
        for impl, ms, error in rows:
            lines.append(
                f"| [{', '.join(map(str, shape))}] | {impl} | {ms:.3f} | {ms / floor:.2f} | {fla / ms:.2f}x | "
                f"{error:.1e} |"
            )
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if not args.no_write:
        write_section(
            args.doc,
            MARKER,
            "Attention backward's delta",
            f"Command: `{command_line('bench/attention_delta.py', argv)}` on {device_name(torch.device('cuda'))}, "
            f"torch {torch.__version__} ({time.strftime('%Y-%m-%d')}); bfloat16 o and do, float32 delta. Medians "
            "of triton.testing.do_bench_cudagraph (GPU time). The floor reads the op's bytes at the bandwidth of a "
            "same-size clone; vs FLA: FLA's time over the row's. "
            f"Total run time {time.perf_counter() - started:.0f} s.",
            table,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
