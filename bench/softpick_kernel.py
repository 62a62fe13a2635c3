"""Speed and memory of flame's fused softpick / rectified attention kernel against torch SDPA's flash softmax.

    python bench/softpick_kernel.py [--seq_lens 1024,2048,4096,16384,65536] [--shapes 16x64,8x128] [--no_write]

Per sequence length T (batch = --tokens // T, at least 1: the rows up to T = --tokens hold the same number of
tokens) and heads x head dim, causal attention on bfloat16 q, k, v [B, T, H, D] (no GQA), for: flame's softpick
kernel, its rectified-softmax variant, torch SDPA restricted to the FlashAttention backend (the softmax flame runs
on CUDA), and the materialized PyTorch reference (reference_attention, O(T^2) memory; "OOM" where it does not fit).
Times are medians of triton.testing.do_bench after one untimed call (compilation, autotuning); "fwd+bwd" is the
forward and the backward of a fixed output gradient. TFLOP/s counts causal attention as FlashAttention does
(forward 2 x 2 x B x H x T^2 x D / 2, backward 2.5 x forward). Peak memory is the most allocated above the inputs
during one forward + backward. The markdown table goes into docs/performance.md between
``<!-- bench_softpick_kernel -->`` markers.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from train_throughput import add_doc_options, command_line, device_name, no_cuda_gpu, write_section  # noqa: E402

from flame.ops.attention import reference_attention  # noqa: E402
from flame.ops.attention.softpick_triton import softpick_attention  # noqa: E402

MARKER = "bench_softpick_kernel"
IMPLS = ("softpick kernel", "rectified kernel", "SDPA flash (softmax)", "reference (softpick)")


def attention_fn(impl: str):
    """q, k, v [B, T, H, D] -> [B, T, H, D] for one of IMPLS."""
    if impl == "softpick kernel":
        return lambda q, k, v: softpick_attention(q, k, v, variant="softpick")
    if impl == "rectified kernel":
        return lambda q, k, v: softpick_attention(q, k, v, variant="rectified")
    if impl == "reference (softpick)":
        return lambda q, k, v: reference_attention(q, k, v, impl="softpick")

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
        return out.transpose(1, 2)

    return sdpa


def measure(impl: str, batch: int, seq_len: int, heads: int, head_dim: int, warmup: int, rep: int) -> dict:
    """{"fwd": ms, "fwd+bwd": ms, "peak": MiB} or {"error": "OOM"}."""
    from triton.testing import do_bench

    fn = attention_fn(impl)
    q, k, v, do = (
        torch.randn(batch, seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        fn(q, k, v).backward(do)

    try:
        forward_backward()  # compilation and autotuning, untimed
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        fwd = do_bench(forward, warmup=warmup, rep=rep, return_mode="median")
        fwd_bwd = do_bench(
            forward_backward, warmup=warmup, rep=rep, grad_to_none=[q, k, v], return_mode="median"
        )
    except torch.cuda.OutOfMemoryError:
        return {"error": "OOM"}
    return {"fwd": fwd, "fwd+bwd": fwd_bwd, "peak": peak}


def table(rows: list[dict]) -> str:
    lines = [
        "| T | B | H x D | implementation | fwd ms | fwd+bwd ms | fwd+bwd / SDPA | fwd+bwd TFLOP/s | peak MiB |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        shape = f"{row['heads']} x {row['head_dim']}"
        head = f"| {row['seq_len']} | {row['batch']} | {shape} | {row['impl']} |"
        if "error" in row:
            lines.append(f"{head} {row['error']} | {row['error']} | | | |")
            continue
        flops = 3.5 * 2 * 2 * row["batch"] * row["heads"] * row["seq_len"] ** 2 * row["head_dim"] / 2
        ratio = f"{row['fwd+bwd'] / row['sdpa']:.2f}" if row.get("sdpa") else ""
        lines.append(
            f"{head} {row['fwd']:.3f} | {row['fwd+bwd']:.3f} | {ratio} | {flops / row['fwd+bwd'] / 1e9:.0f} | "
            f"{row['peak']:,.0f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_lens", default="1024,2048,4096,16384,65536", help="comma separated")
    parser.add_argument("--shapes", default="16x64,8x128", help="comma separated heads x head dim")
    parser.add_argument("--tokens", type=int, default=16384, help="batch x T of every case")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma separated: " + ", ".join(IMPLS))
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    add_doc_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if no_cuda_gpu("bench/softpick_kernel.py"):
        return 1
    impls = args.impls.split(",")
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        print(f"unknown --impls {unknown}; choose from {list(IMPLS)}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    rows = []
    for shape in args.shapes.split(","):
        heads, head_dim = (int(x) for x in shape.split("x"))
        for seq_len in (int(x) for x in args.seq_lens.split(",")):
            batch = max(1, args.tokens // seq_len)
            case = {"seq_len": seq_len, "batch": batch, "heads": heads, "head_dim": head_dim}
            results = {
                impl: measure(impl, batch, seq_len, heads, head_dim, args.warmup, args.rep) for impl in impls
            }
            sdpa = results.get("SDPA flash (softmax)", {}).get("fwd+bwd")
            for impl, result in results.items():
                rows.append({**case, "impl": impl, "sdpa": sdpa, **result})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    print("\n" + text)
    if not args.no_write:
        command = command_line("bench/softpick_kernel.py", argv)
        write_section(
            args.doc,
            MARKER,
            "Softpick attention kernel",
            f"Command: `{command}` on {device_name(torch.device('cuda'))}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}); causal, bfloat16, {args.tokens:,} tokens per case (B = tokens / T), "
            "at least one sequence, no GQA. Medians of triton.testing.do_bench; peak memory above the inputs during one forward + "
            f"backward. Total run time {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
