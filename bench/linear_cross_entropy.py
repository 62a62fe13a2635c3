"""Time and memory of the language-model loss from the final hidden states, fused against unfused.

    python bench/linear_cross_entropy.py                        # 16,384 tokens x vocab 32,000 x hidden 1,024
    python bench/linear_cross_entropy.py --device cpu --tiny    # smoke test of the script itself

Per implementation, forward + backward of the summed loss of bfloat16 hidden states [tokens, hidden] and a bfloat16
lm_head weight [vocab, hidden] (float32 on the CPU), with a tenth of the labels ignored, z_loss 0 (FLA's kernel has
none; ``--z_loss`` adds it to flame's rows):
- unfused: ``hidden @ weight.T`` (the whole logits) then flame/loss.py's ``loss_sums`` in float32, as training with
  ``fuse_linear_cross_entropy`` false computes it;
- flame fused: flame/ops/linear_cross_entropy.py's PyTorch implementation (chunk size ``--chunk_size``, default
  Liger's rule), the dispatch table's ``torch`` backend;
- FLA fused: FLA 0.6.0's Triton ``fused_linear_cross_entropy_loss`` (CUDA only), the table's ``fla`` backend;
- Liger fused: the table's ``liger`` backend, its default where ``liger-kernel`` is installed (the ``liger``
  extra): Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (Triton; its z-loss is ``lse_square_scale``; the
  weight gradient accumulated in float32), on a GPU, or on a CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
Times are medians of ``--repeats`` timed runs after two untimed ones (CUDA events on a GPU); peak is the most memory
allocated during one forward + backward beyond the inputs, weight and their gradients' buffers. The markdown table
goes into docs/performance.md between ``<!-- bench_linear_cross_entropy -->`` markers.
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from train_throughput import add_doc_options, command_line, device_name, write_section  # noqa: E402

from flame.loss import IGNORE_INDEX, loss_sums  # noqa: E402
from flame.ops import dispatch  # noqa: E402
from flame.ops.linear_cross_entropy import (  # noqa: E402
    default_chunk_size,
    liger_linear_cross_entropy,
    linear_cross_entropy,
)

MARKER = "bench_linear_cross_entropy"
TINY = {"tokens": 96, "vocab": 300, "hidden": 32}


def unfused(hidden, weight, labels, z_loss, chunk_size):
    cross_entropy, z_term = loss_sums(hidden @ weight.T, labels, z_loss=z_loss > 0)
    return cross_entropy + z_loss * z_term


def fused(backend: str):
    def loss(hidden, weight, labels, z_loss, chunk_size):
        dispatch.pin("linear_cross_entropy", backend if hidden.is_cuda else None)
        return linear_cross_entropy(hidden, weight, labels, IGNORE_INDEX, z_loss, chunk_size)[0]

    return loss


def liger(hidden, weight, labels, z_loss, chunk_size):
    return liger_linear_cross_entropy(hidden, weight, labels, IGNORE_INDEX, z_loss, chunk_size, 0.0)[0]


def implementations(device: torch.device, z_loss: float) -> dict:
    impls = {"unfused (logits + loss_sums)": unfused, "flame fused (PyTorch, chunked)": fused("torch")}
    if device.type == "cuda" and z_loss == 0:
        impls["FLA fused (Triton)"] = fused("fla")
    triton_runs = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if triton_runs and importlib.util.find_spec("liger_kernel") is not None:
        impls["Liger fused (Triton)"] = liger
    return impls


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median ms of ``fn()`` after two untimed calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def measure(args: argparse.Namespace, device: torch.device) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, generator=generator).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, device=device, generator=generator) / args.hidden**0.5).to(
        dtype
    )
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=generator)
    labels[torch.rand(args.tokens, device=device, generator=generator) < 0.1] = IGNORE_INDEX
    hidden.requires_grad_()
    weight.requires_grad_()
    rows = []
    for name, loss_fn in implementations(device, args.z_loss).items():

        def forward_backward(loss_fn=loss_fn):
            hidden.grad = weight.grad = None
            loss = loss_fn(hidden, weight, labels, args.z_loss, args.chunk_size)
            loss.backward()
            return loss

        loss = forward_backward().item()
        milliseconds = timed(forward_backward, device, args.repeats)
        peak = None
        if device.type == "cuda":
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
            forward_backward()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated(device) - baseline) / 2**30
        rows.append({"impl": name, "ms": milliseconds, "peak": peak, "loss": loss})
        print(table(args, rows[-1:]).splitlines()[-1], flush=True)
    dispatch.pin("linear_cross_entropy", None)
    return rows


def table(args: argparse.Namespace, rows: list[dict]) -> str:
    lines = [
        "| tokens x vocab x hidden | implementation | fwd+bwd ms | peak GiB | loss / tokens |",
        "|---|---|---:|---:|---:|",
    ]
    shape = f"{args.tokens:,} x {args.vocab:,} x {args.hidden:,}"
    for row in rows:
        peak = "-" if row["peak"] is None else f"{row['peak']:.2f}"
        lines.append(
            f"| {shape} | {row['impl']} | {row['ms']:.2f} | {peak} | {row['loss'] / args.tokens:.4f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk_size", type=int, default=None, help="flame's chunk (default: Liger's rule)")
    parser.add_argument("--z_loss", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help=f"{TINY} (a smoke test)")
    add_doc_options(parser)
    args = parser.parse_args(argv)
    if args.tiny:
        vars(args).update(TINY, repeats=2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "bench/linear_cross_entropy.py --device cuda needs a CUDA GPU; none is visible", file=sys.stderr
        )
        return 1
    started = time.perf_counter()
    rows = measure(args, device)
    text = table(args, rows)
    print("\n" + text)
    if not args.no_write:
        command = command_line("bench/linear_cross_entropy.py", argv)
        chunk = args.chunk_size or default_chunk_size(args.tokens, args.vocab, args.hidden)
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        write_section(
            args.doc,
            MARKER,
            "Fused linear cross-entropy",
            f"Command: `{command}` on {device_name(device)}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}); {dtype} hidden states and weight, a tenth of the labels ignored, "
            f"z_loss {args.z_loss}, flame's chunk {chunk} tokens. Forward + backward of the summed loss, medians of "
            f"{args.repeats} runs; peak is the memory allocated beyond the inputs during one forward + backward "
            "(GPU only). "
            f"Total run time {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
