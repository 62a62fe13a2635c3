"""Speed of flame's Triton selective scan (Mamba's recurrence, flame/ops/selective_scan) against the PyTorch token
loop that defines it, and the memory-bandwidth floor.

    python bench/selective_scan.py [--shapes 8x2048x1536x16] [--no_write]
    python bench/selective_scan.py --tiles 16x8x4,8x8x8 --no_write   # flame's kernels split other ways, side by side

Per shape batch x T x D x N: u, delta [batch, T, D], B, C [batch, T, N] in bfloat16 and A [D, N] in float32, as
FLA's Mamba layer (hidden 768, expand 2, state 16: the 97M mamba of docs/models.md) calls it in training. Times are
medians of triton.testing.do_bench_cudagraph (replays of a CUDA graph: GPU time) after one untimed call
(compilation); "fwd+bwd" is the forward and torch.autograd.grad of a fixed output gradient. The token loop runs
at batch 1 (its autograd keeps a state per token) and is scaled to the shape's batch. The floor is the time the
op's bytes take at the bandwidth of a same-size `clone` of u: the forward reads u, delta, B, C and writes y (about
2.5 clones of u at N much smaller than D), forward + backward also read them again with dy and write du, ddelta
(about 6). ``--tiles`` times flame's kernels with each split of the work given (chunk x block_d x warps,
flame.ops.selective_scan.triton_kernel.ScanTiles; default: the one the op uses). The markdown table goes into
docs/performance.md between ``<!-- bench_selective_scan -->`` markers.
"""

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import short_conv  # noqa: E402
from train_throughput import add_doc_options, command_line, device_name, no_cuda_gpu, write_section  # noqa: E402

from flame.ops.selective_scan import selective_scan_recurrent  # noqa: E402
from flame.ops.selective_scan.triton_kernel import TILES, ScanTiles, selective_scan_triton  # noqa: E402

MARKER = "bench_selective_scan"
CLONES = {"fwd": 2.5, "fwd+bwd": 6.0}  # bytes moved, in clones of u (one read and one write)


def inputs(batch: int, length: int, dim: int, states: int, generator: torch.Generator) -> list[torch.Tensor]:
    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype).requires_grad_()

    delta = torch.nn.functional.softplus(torch.randn(batch, length, dim, device="cuda", generator=generator))
    A = -torch.rand(dim, states, device="cuda", generator=generator) * 2 - 0.1
    return [randn(batch, length, dim), delta.bfloat16().requires_grad_(), A.requires_grad_(),
            randn(batch, length, states), randn(batch, length, states)]  # fmt: skip


def timings(scan, args: list[torch.Tensor], rep: int) -> dict[str, float]:
    from triton.testing import do_bench_cudagraph

    dy = torch.randn_like(args[0])

    def forward():
        with torch.no_grad():
            scan(*args)

    def forward_backward():
        torch.autograd.grad(scan(*args)[0], args, dy)

    forward_backward()  # compilation, untimed
    return {mode: do_bench_cudagraph(fn, rep=rep, return_mode="median")
            for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward))}  # fmt: skip


def measure(batch: int, length: int, dim: int, states: int, rep: int, tiles: list[ScanTiles]) -> list[dict]:
    """[{"impl", "fwd", "fwd+bwd"}] in ms, the floor first."""
    from triton.testing import do_bench_cudagraph

    generator = torch.Generator("cuda").manual_seed(0)
    args = inputs(batch, length, dim, states, generator)
    clone = do_bench_cudagraph(lambda: args[0].detach().clone(), rep=rep, return_mode="median")
    rows = [{"impl": "floor (clone bandwidth)", **{mode: clones * clone for mode, clones in CLONES.items()}}]
    for split in tiles:
        scan = functools.partial(selective_scan_triton, tiles=split)
        used = " (the op's)" if split == TILES else ""
        rows.append({"impl": f"flame Triton (chunked scan), tiles {split}{used}", **timings(scan, args, rep)})
    loop = timings(selective_scan_recurrent, inputs(1, length, dim, states, generator), rep)
    rows.append(
        {"impl": f"PyTorch token loop (batch 1, x {batch})", **{m: batch * t for m, t in loop.items()}}
    )
    return rows


def table(rows: list[dict]) -> str:
    return short_conv.table(rows, shape_header="batch x T x D x N")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x2048x1536x16", help="comma separated batch x T x D x N")
    parser.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph repetitions, ms")
    parser.add_argument(
        "--tiles", default=str(TILES), help="comma separated chunk x block_d x warps of flame's kernels"
    )
    add_doc_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if no_cuda_gpu("bench/selective_scan.py"):
        return 1
    started = time.perf_counter()
    rows = []
    for shape in args.shapes.split(","):
        batch, length, dim, states = (int(x) for x in shape.split("x"))
        results = measure(
            batch, length, dim, states, args.rep, [ScanTiles.parse(t) for t in args.tiles.split(",")]
        )
        for result in results:
            rows.append({**result, "shape": shape, "floor": results[0]})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    print("\n" + text)
    if not args.no_write:
        write_section(
            args.doc,
            MARKER,
            "Selective scan kernel",
            f"Command: `{command_line('bench/selective_scan.py', argv)}` on {device_name(torch.device('cuda'))}, "
            f"torch {torch.__version__} ({time.strftime('%Y-%m-%d')}); bfloat16 u, delta, B, C, float32 A. Medians "
            "of triton.testing.do_bench_cudagraph (GPU time); bwd = fwd+bwd - fwd. The floor moves the op's bytes "
            "at the bandwidth of a same-size clone of u. "
            f"Total run time {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
