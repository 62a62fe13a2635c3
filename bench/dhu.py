"""flame's dh recurrence (the gated delta rule's chunk_gated_delta_rule_bwd_dhu) per launch setting, beside FLA's.

    python bench/dhu.py                                    # the three head shapes below, 8 x 2048 tokens
    python bench/dhu.py --shapes 6x256x512 --no_write

Shapes are heads x K x V of a Gated DeltaNet layer: 6x256x512 (configs/gated_deltanet_340M.json), 16x96x192
(configs/olmo_1b_*.json) and 16x128x128 (Qwen3-Next-like heads). The call is the one the backward makes in
training: q, k (unit rows), w, do, dv in bf16, float32 log2-decay cumulated within 64-token chunks, the states
stored [V, K]. Rows: FLA 0.6.0's Triton kernel (the anchor: what FLA's backward runs), flame's Triton kernel as
training runs it (autotuned; the row names the setting it chose), then each of its launch settings that fits the
GPU's shared memory, pinned. Times are medians of triton.testing.do_bench_cudagraph (GPU time) after one untimed
call. The error is the larger relative RMS error ||x - ref|| / ||ref|| of dh and dv2 against flame's PyTorch
reference in float64 on the same inputs. The table goes into docs/performance.md between ``<!-- bench_dhu_<device>
-->`` markers.
"""

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from dqkwg import table, time_rows  # noqa: E402
from train_throughput import (  # noqa: E402
    add_doc_options,
    command_line,
    device_name,
    device_slug,
    no_cuda_gpu,
    write_section,
)

MARKER = "bench_dhu"
CHUNK = 64
ANCHOR = "FLA Triton"


def inputs(shape: str, batch: int, seq_len: int) -> tuple[tuple, dict]:
    """(q, k, w, do, dv) and the keyword arguments of one call at heads x K x V."""
    heads, key_dim, value_dim = (int(n) for n in shape.split("x"))
    dev = "cuda"

    def draw(*size, scale=1.0):
        return (torch.randn(*size, device=dev) * scale).to(torch.bfloat16)

    tokens = (batch, seq_len, heads)
    unit = [torch.nn.functional.normalize(torch.randn(*tokens, key_dim, device=dev), dim=-1) for _ in "qk"]
    q, k = (x.to(torch.bfloat16) for x in unit)
    w = draw(*tokens, key_dim, scale=key_dim**-0.5)
    do, dv = draw(*tokens, value_dim), draw(*tokens, value_dim)
    decay = -torch.rand(batch, seq_len // CHUNK, CHUNK, heads, device=dev) * 0.1
    g = decay.cumsum(2).view(batch, seq_len, heads)
    kwargs = dict(g=g, scale=key_dim**-0.5, state_v_first=True, chunk_size=CHUNK)
    return (q, k, w, do, dv), kwargs


def launch_text(launch: dict) -> str:
    return "BV {BV}, {num_warps} warps, {num_stages} stages".format(**launch)


def implementations(key_dim: int) -> dict:
    """Row name -> call: FLA's kernel, flame's autotuned, then flame's pinned to each setting that fits."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu

    from flame.ops.gated_delta_rule import dhu_triton

    def fla_call(q, k, w, do, dv, **kwargs):
        return chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, **kwargs)

    rows = {ANCHOR: fla_call, "flame Triton, autotuned": dhu_triton.chunk_bwd_dhu_triton}
    limit = dhu_triton.shared_memory_limit(torch.cuda.current_device())
    for config in dhu_triton.fitting_configs(dhu_triton.key_block(key_dim), CHUNK, 2, True, limit):
        launch = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
        rows[f"flame Triton, {launch_text(launch)}"] = functools.partial(
            dhu_triton.chunk_bwd_dhu_triton, launch=launch
        )
    return rows


def chosen_setting() -> str:
    """The setting flame's autotuner chose for the last shape it tuned."""
    from flame.ops.gated_delta_rule import dhu_triton

    best = dhu_triton._dhu_kernel_tuned.best_config
    return launch_text({**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages})


def measure(shape: str, args: argparse.Namespace) -> list[tuple[str, float, float, str]]:
    """[(row name, ms, error, why the call was refused or '')] for one shape."""
    from flame.ops.gated_delta_rule.dhu_reference import chunk_bwd_dhu_torch

    tensors, kwargs = inputs(shape, args.batch, args.seq_len)
    f64 = {n: x.double() if torch.is_tensor(x) and x.is_floating_point() else x for n, x in kwargs.items()}
    want = chunk_bwd_dhu_torch(*(x.double() for x in tensors), **f64)
    calls = implementations(tensors[0].shape[-1])
    rows = time_rows(shape, calls, tensors, kwargs, want, chosen_setting, args.rep)
    del want
    torch.cuda.empty_cache()
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", default="6x256x512,16x96x192,16x128x128", help="heads x K x V, comma separated"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048, help="a multiple of 64")
    parser.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph repetitions, ms")
    add_doc_options(parser)
    args = parser.parse_args(argv)
    if args.seq_len % CHUNK:
        parser.error(f"--seq_len must be a multiple of {CHUNK}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if no_cuda_gpu("bench/dhu.py"):
        return 1
    # tuning results into Triton's cache, where scripts/autotune_bundle.py finds them for the shipped bundle
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    started = time.perf_counter()
    results = {shape: measure(shape, args) for shape in args.shapes.split(",")}
    text = table(results, ANCHOR)
    print("\n" + text)
    if not args.no_write:
        device = device_name(torch.device("cuda"))
        write_section(
            args.doc,
            f"{MARKER}_{device_slug(device)}",
            f"flame's dh recurrence per launch setting, {device}",
            f"Command: `{command_line('bench/dhu.py', argv)}` on {device}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}); {args.batch} x {args.seq_len} tokens, bf16, the states stored [V, K]. "
            "Medians of triton.testing.do_bench_cudagraph (GPU time). "
            f"Total run time {time.perf_counter() - started:.0f} s.",
            text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
