"""flame's sequential recurrences of the gated delta rule per launch setting, beside FLA's: the state recurrence
(chunk_gated_delta_rule_fwd_h, run by the forward and again by the backward's recompute), the forward's state
recurrence and output in one pass (fwd_o: in place of chunk_gated_delta_rule_fwd_h and chunk_fwd_o in a forward
that keeps no chunk states), the dh recurrence (chunk_gated_delta_rule_bwd_dhu, the backward's) given dv, and the
dh recurrence forming the intra-chunk dv itself (dhu_dv: in place of chunk_bwd_dv_local and the dh recurrence).

    python bench/recurrences.py                          # all four, the three head shapes below, 8 x 2048 tokens
    python bench/recurrences.py --recurrences fwd_h --shapes 6x256x512 --no_write
    python bench/recurrences.py --recurrences dhu --settings 64/8/2,64/8/1,128/8/1 --no_write   # settings of choice

Shapes are heads x K x V of a Gated DeltaNet layer: 6x256x512 (configs/gated_deltanet_340M.json), 16x96x192
(configs/olmo_1b_*.json) and 16x128x128 (Qwen3-Next-like heads). Each call is the one training makes: bf16 tensors
(q and k with unit rows), float32 log2-decay cumulated within 64-token chunks, the states stored [V, K] as FLA's
layer asks, no initial or final state. Rows: FLA 0.6.0's Triton kernels (the anchor: what FLA runs; for fwd_o its
state recurrence and then its output kernel, and beside it flame's state recurrence and then FLA's output kernel;
for dhu_dv its chunk_bwd_dv_local and then its dh recurrence, and beside it FLA's chunk_bwd_dv_local and then
flame's dh recurrence given dv),
flame's Triton kernel as training runs it (autotuned; the row names the setting it chose), then each of its launch
settings that fits the GPU's shared memory, pinned, or the settings ``--settings BV/warps/stages`` names (a setting
that does not compile gets a row with the compiler's reason). Times are medians of
triton.testing.do_bench_cudagraph (GPU time) after one untimed call. The error is the largest relative RMS error
||x - ref|| / ||ref|| over the results against flame's PyTorch reference in float64 on the same inputs. Each
recurrence's table goes into docs/performance.md between ``<!-- bench_<recurrence>_<device> -->`` markers, written
again after each shape: the shapes this run measured replace their rows, and the section keeps the rows of the
other shapes with the runs that measured them (at the same tokens), so a run stopped part-way (a device call's time
limit) leaves the rows it made and names the run of each. The tuning results stay in Triton's cache, where
scripts/autotune_bundle.py finds them for the shipped bundle.
"""

import argparse
import functools
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from dqkwg import launch_settings, measure_and_write, settings_argument, table, time_rows  # noqa: E402
from train_throughput import (  # noqa: E402
    add_doc_options,
    command_line,
    device_name,
    device_slug,
    no_cuda_gpu,
)

CHUNK = 64
ANCHOR = "FLA Triton"


@dataclass(frozen=True)
class Recurrence:
    title: str  # the doc section's
    tensors: tuple[str, ...]  # the call's tensor arguments, in order
    fla_function: str  # in fla.ops.common.chunk_delta_h
    # flame's kernel module in flame.ops.gated_delta_rule: its function, autotuned kernel, reference
    module: str
    function: str
    kernel: str
    reference: str
    extra: dict  # keyword arguments besides the gate, the layout and the chunk size
    then_output: bool = False  # the call replaces fla_function followed by FLA's chunk_fwd_o (fwd_o)
    local_dv: bool = False  # the call replaces FLA's chunk_bwd_dv_local followed by fla_function (dhu_dv)


RECURRENCES = {
    "fwd_h": Recurrence(
        "flame's state recurrence per launch setting", ("k", "w", "u"), "chunk_gated_delta_rule_fwd_h",
        "fwd_h_triton", "chunk_fwd_h_triton", "_fwd_h_kernel_tuned", "fwd_h_reference.chunk_fwd_h_torch",
        {"output_final_state": False},
    ),
    "fwd_o": Recurrence(
        "flame's state recurrence with the output per launch setting", ("q", "k", "w", "u"),
        "chunk_gated_delta_rule_fwd_h", "fwd_o_triton", "chunk_fwd_o_triton", "_fwd_o_kernel_tuned",
        "fwd_o_reference.chunk_fwd_ho_torch", {"output_final_state": False}, then_output=True,
    ),
    "dhu": Recurrence(
        "flame's dh recurrence per launch setting", ("q", "k", "w", "do", "dv"), "chunk_gated_delta_rule_bwd_dhu",
        "dhu_triton", "chunk_bwd_dhu_triton", "_dhu_kernel_tuned", "dhu_reference.chunk_bwd_dhu_torch", {},
    ),
    "dhu_dv": Recurrence(
        "flame's dh recurrence with the intra-chunk dv per launch setting", ("q", "k", "w", "do"),
        "chunk_gated_delta_rule_bwd_dhu", "dhu_triton", "chunk_bwd_dhu_triton", "_dhu_kernel_tuned",
        "dhu_reference.chunk_bwd_dhu_torch", {"dv": None}, local_dv=True,
    ),
}  # fmt: skip


def inputs(recurrence: Recurrence, shape: str, batch: int, seq_len: int) -> tuple[tuple, dict]:
    """The call's tensors and keyword arguments at heads x K x V."""
    heads, key_dim, value_dim = (int(n) for n in shape.split("x"))
    tokens = (batch, seq_len, heads)
    widths = {"q": key_dim, "k": key_dim, "w": key_dim, "u": value_dim, "do": value_dim, "dv": value_dim}
    tensors = []
    for name in recurrence.tensors:
        x = torch.randn(*tokens, widths[name], device="cuda")
        if name in ("q", "k"):
            x = torch.nn.functional.normalize(x, dim=-1)
        elif name == "w":
            x = x * key_dim**-0.5
        tensors.append(x.to(torch.bfloat16))
    decay = -torch.rand(batch, seq_len // CHUNK, CHUNK, heads, device="cuda") * 0.1
    kwargs = dict(g=decay.cumsum(2).view(*tokens), state_v_first=True, chunk_size=CHUNK, **recurrence.extra)
    if "q" in recurrence.tensors:  # fwd_o, dhu, dhu_dv
        kwargs["scale"] = key_dim**-0.5
    return tuple(tensors), kwargs


def state_recurrence_then_output(state_recurrence, q, k, w, u, scale, **kwargs):
    """(o, final state) of ``state_recurrence`` (FLA's chunk_gated_delta_rule_fwd_h or flame's) and then FLA's
    chunk_fwd_o: the forward's two kernels that fwd_o's one replaces."""
    from fla.ops.common.chunk_o import chunk_fwd_o

    h, v_new, final_state = state_recurrence(k=k, w=w, u=u, **kwargs)
    o = chunk_fwd_o(
        q=q,
        k=k,
        v=v_new,
        h=h,
        g=kwargs["g"],
        scale=scale,
        state_v_first=kwargs["state_v_first"],
        chunk_size=kwargs["chunk_size"],
    )
    return o, final_state


def dv_local_then_dh_recurrence(dh_recurrence, q, k, w, do, dv, scale, **kwargs):
    """(dh, dh0, dv2) of FLA's chunk_bwd_dv_local and then ``dh_recurrence`` (FLA's or flame's, given that dv): the
    backward's two kernels that flame's dh recurrence without dv replaces (``dv`` is that call's None)."""
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    dv = chunk_bwd_dv_local(q=q, k=k, do=do, g=kwargs["g"], scale=scale, chunk_size=kwargs["chunk_size"])
    return dh_recurrence(q=q, k=k, w=w, do=do, dv=dv, scale=scale, **kwargs)


def launch_text(launch: dict) -> str:
    return "BV {BV}, {num_warps} warps, {num_stages} stages".format(**launch)


def flame_module(recurrence: Recurrence):
    return importlib.import_module(f"flame.ops.gated_delta_rule.{recurrence.module}")


def parse_settings(text: str | None) -> list[dict] | None:
    """``--settings`` (BV/warps/stages, comma separated) as launch settings; None: the kernel's tuning settings that
    fit the GPU."""
    return None if text is None else launch_settings(text, ("BV", "num_warps", "num_stages"))


def fitting_settings(recurrence: Recurrence, key_dim: int) -> list[dict]:
    """The launch settings of flame's kernel whose tiles fit this GPU's shared memory at bf16 value-first calls."""
    from flame.ops.gated_delta_rule.chunk_recurrence import key_block, shared_memory_limit

    limit = shared_memory_limit(torch.cuda.current_device())
    configs = flame_module(recurrence).fitting_configs(key_block(key_dim), CHUNK, 2, True, limit)
    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in configs]


def implementations(recurrence: Recurrence, key_dim: int, settings: list[dict] | None = None) -> dict:
    """Row name -> call: FLA's kernel (fwd_o: FLA's state recurrence and output kernel, then flame's state recurrence
    and FLA's output kernel; dhu_dv: FLA's chunk_bwd_dv_local and dh recurrence, then FLA's chunk_bwd_dv_local and
    flame's dh recurrence), flame's autotuned, then flame's pinned to each of ``settings`` (None: each tuning
    setting that fits)."""
    from fla.ops.common import chunk_delta_h

    fla_function = getattr(chunk_delta_h, recurrence.fla_function)
    module = flame_module(recurrence)
    flame_function = getattr(module, recurrence.function)
    if recurrence.then_output:
        from flame.ops.gated_delta_rule.fwd_h_triton import chunk_fwd_h_triton

        rows = {
            ANCHOR: functools.partial(state_recurrence_then_output, fla_function),
            "flame's state recurrence, then FLA's output": functools.partial(
                state_recurrence_then_output, chunk_fwd_h_triton
            ),
        }
    elif recurrence.local_dv:
        rows = {
            ANCHOR: functools.partial(dv_local_then_dh_recurrence, fla_function),
            "FLA's dv_local, then flame's dh recurrence": functools.partial(
                dv_local_then_dh_recurrence, flame_function
            ),
        }
    else:

        def fla_call(*tensors, **kwargs):
            return fla_function(**dict(zip(recurrence.tensors, tensors)), **kwargs)

        rows = {ANCHOR: fla_call}
    rows["flame Triton, autotuned"] = flame_function
    for launch in settings if settings is not None else fitting_settings(recurrence, key_dim):
        rows[f"flame Triton, {launch_text(launch)}"] = functools.partial(flame_function, launch=launch)
    return rows


def measure(
    recurrence: Recurrence, shape: str, args: argparse.Namespace
) -> list[tuple[str, float, float, str]]:
    """[(row name, ms, error, why the call was refused or '')] for one shape."""
    module_name, function = recurrence.reference.split(".")
    reference = getattr(importlib.import_module(f"flame.ops.gated_delta_rule.{module_name}"), function)
    tensors, kwargs = inputs(recurrence, shape, args.batch, args.seq_len)
    f64 = {n: x.double() if torch.is_tensor(x) and x.is_floating_point() else x for n, x in kwargs.items()}
    want = reference(*(x.double() for x in tensors), **f64)
    tuned = getattr(flame_module(recurrence), recurrence.kernel)

    def chosen_setting() -> str:
        best = tuned.best_config
        return launch_text({**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages})

    calls = implementations(recurrence, tensors[0].shape[-1], args.settings)
    rows = time_rows(shape, calls, tensors, kwargs, want, chosen_setting, args.rep)
    del want
    torch.cuda.empty_cache()
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recurrences", default=",".join(RECURRENCES), help=f"comma separated of {', '.join(RECURRENCES)}"
    )
    parser.add_argument(
        "--shapes", default="6x256x512,16x96x192,16x128x128", help="heads x K x V, comma separated"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048, help="a multiple of 64")
    parser.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph repetitions, ms")
    parser.add_argument(
        "--settings",
        default=None,
        help="BV/warps/stages, comma separated (default: every tuning setting that fits)",
    )
    add_doc_options(parser)
    args = parser.parse_args(argv)
    if args.seq_len % CHUNK:
        parser.error(f"--seq_len must be a multiple of {CHUNK}")
    settings_argument(parser, args, parse_settings)
    if unknown := set(args.recurrences.split(",")) - set(RECURRENCES):
        parser.error(f"unknown recurrences {sorted(unknown)}; choose from {', '.join(RECURRENCES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if no_cuda_gpu("bench/recurrences.py"):
        return 1
    device = device_name(torch.device("cuda"))
    command = command_line("bench/recurrences.py", argv)
    for name in args.recurrences.split(","):
        recurrence = RECURRENCES[name]
        marker = f"bench_{name}_{device_slug(device)}"
        title = f"{recurrence.title}, {device}"
        results = measure_and_write(
            args.shapes.split(","),
            lambda shape, recurrence=recurrence: measure(recurrence, shape, args),
            args,
            command,
            marker,
            title,
            ANCHOR,
        )
        print(f"\n{recurrence.title}\n\n{table(results, ANCHOR)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
