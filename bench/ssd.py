"""Speed of Mamba-2's scan (flame/ops/ssd): FLA's chunked simple-GLA Triton kernel, which the op runs on CUDA, against
flame's chunked PyTorch implementation, which ran there before.

    python bench/ssd.py [--shapes 8x2048x24x64x128] [--no_write]

Per shape batch x T x heads x head_dim x state: x [batch, T, heads, head_dim], dt [batch, T, heads] (softplus of a
normal), A [heads] (negative), B, C [batch, T, heads, state], as flame's Mamba2 layer calls the op (hidden 768,
expand 2, head_dim 64, state 128: the 97M mamba2 of docs/models.md's family table). The layer passes float32; the
bfloat16 row gives x, B and C in bfloat16 (dt and A float32), as mamba_ssm's kernels take them. Times are medians of
triton.testing.do_bench after one untimed call (compilation and FLA's autotuning); "fwd+bwd"
is the forward and torch.autograd.grad of a fixed output gradient for every input. "error" is the relative RMS
error of y and of dx against the same inputs in float64 through the chunked PyTorch implementation; "peak GiB" the
CUDA memory high-water mark of one forward and backward. The markdown table goes into docs/performance.md between
``<!-- bench_ssd -->`` markers.
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

from flame.ops.ssd import fla_ssd, ssd_chunked  # noqa: E402

MARKER = "bench_ssd"
VARIANTS = (  # (implementation, its function, dtype of x, B and C)
    ("flame PyTorch chunked, float32", ssd_chunked, torch.float32),
    ("FLA chunk_simple_gla, float32 (TF32 products)", fla_ssd, torch.float32),
    ("FLA chunk_simple_gla, bfloat16 x, B, C", fla_ssd, torch.bfloat16),
)


def inputs(batch: int, length: int, heads: int, head_dim: int, state: int) -> list[torch.Tensor]:
    """float64 leaves on the GPU (every variant casts them)."""
    generator = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=generator, dtype=torch.float64)

    dt = torch.nn.functional.softplus(randn(batch, length, heads) - 2)
    A = -torch.rand(heads, device="cuda", generator=generator, dtype=torch.float64) * 4 - 0.5
    return [randn(batch, length, heads, head_dim), dt, A, randn(batch, length, heads, state),
            randn(batch, length, heads, state)]  # fmt: skip


def cast(args: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    x, dt, A, B, C = args
    wide = torch.promote_types(dtype, torch.float32)  # dt and A stay float32 (float64 for the reference)
    return [
        t.detach().to(d).requires_grad_()
        for t, d in ((x, dtype), (dt, wide), (A, wide), (B, dtype), (C, dtype))
    ]


def rms_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    ours, reference = ours.double(), reference.double()
    return ((ours - reference).square().mean().sqrt() / reference.square().mean().sqrt()).item()


def measure(shape: tuple[int, ...], rep: int) -> list[dict]:
    from triton.testing import do_bench

    base = inputs(*shape)
    dy = torch.randn(base[0].shape, device="cuda", dtype=torch.float64)
    reference_args = cast(base, torch.float64)
    reference_y = ssd_chunked(*reference_args)[0]
    reference_dx = torch.autograd.grad(reference_y, reference_args[0], dy)[0]
    del reference_args
    rows = []
    for name, scan, dtype in VARIANTS:
        args = cast(base, dtype)
        grad = dy.to(dtype)

        def forward(scan=scan, args=args):
            with torch.no_grad():
                scan(*args)

        def forward_backward(scan=scan, args=args, grad=grad):
            return torch.autograd.grad(scan(*args)[0], args, grad)

        started = time.perf_counter()
        y = scan(*args)[0]
        dx = torch.autograd.grad(y, args, grad)[0]
        torch.cuda.synchronize()
        first_call = time.perf_counter() - started
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        times = {m: do_bench(fn, rep=rep, return_mode="median")
                 for m, fn in (("fwd", forward), ("fwd+bwd", forward_backward))}  # fmt: skip
        rows.append({"shape": "x".join(map(str, shape)), "impl": name, **times, "peak": peak,
                     "first_call": first_call, "error_y": rms_error(y, reference_y),
                     "error_dx": rms_error(dx, reference_dx)})  # fmt: skip
        rows[-1]["speed-up"] = rows[0]["fwd+bwd"] / rows[-1]["fwd+bwd"]
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        del args, y, dx
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| batch x T x heads x head_dim x state | implementation | fwd ms | bwd ms | fwd+bwd ms | "
        "speed-up (fwd+bwd) | peak GiB | error y, dx | first call s |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['shape']} | {row['impl']} | {row['fwd']:.3f} | {row['fwd+bwd'] - row['fwd']:.3f} | "
            f"{row['fwd+bwd']:.3f} | {row['speed-up']:.2f}x | {row['peak']:.2f} | "
            f"{row['error_y']:.1e}, {row['error_dx']:.1e} | {row['first_call']:.1f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", default="8x2048x24x64x128", help="comma separated batch x T x heads x head_dim x state"
    )
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    add_doc_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if no_cuda_gpu("bench/ssd.py"):
        return 1
    started = time.perf_counter()
    rows = []
    for shape in args.shapes.split(","):
        rows += measure(tuple(int(x) for x in shape.split("x")), args.rep)
    text = table(rows)
    print("\n" + text)
    if not args.no_write:
        write_section(
            args.doc,
            MARKER,
            "Mamba-2's scan",
            f"Command: `{command_line('bench/ssd.py', argv)}` on {device_name(torch.device('cuda'))}, "
            f"torch {torch.__version__} ({time.strftime('%Y-%m-%d')}); dt and A float32, x, B and C as each row "
            "says. Medians of triton.testing.do_bench; bwd = fwd+bwd - fwd; speed-up against "
            "the shape's first row; error: relative RMS against float64. "
            f"Total run time {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
