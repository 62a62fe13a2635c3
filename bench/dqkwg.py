"""flame's dq/dk/dw/dg kernel (the gated delta rule's chunk_bwd_dqkwg) per launch setting, beside FLA's TileLang one.

    python bench/dqkwg.py                                  # the three head shapes below, 8 x 2048 tokens
    python bench/dqkwg.py --shapes 6x256x512 --settings 64/64/4/3,128/64/8/3 --no_write   # 128-wide key blocks

Shapes are heads x K x V of a Gated DeltaNet layer: 6x256x512 (configs/gated_deltanet_340M.json), 16x96x192
(configs/olmo_1b_*.json) and 16x128x128 (Qwen3-Next-like heads). The call is the one FLA's backward makes: q, k, v,
w, do, dv in bf16, the chunk states h and their gradient dh in bf16 stored [V, K], float32 log2-decay, 64-token
chunks. Rows: flame's Triton kernel as a training job runs it (autotuned; the row names the setting it chose), then
each launch setting pinned (``--settings BK/BV/warps/stages``, by default every setting the kernel tunes over, all
with its 64-wide key blocks), then FLA's TileLang kernel where tilelang and nvcc are installed (the anchor: FLA
serves this call with it on Hopper).
Times are medians of triton.testing.do_bench_cudagraph (GPU time, the call's small allocations included) after one
untimed call. The error is the largest relative RMS error ||x - ref|| / ||ref|| of dq, dk, dw and dg against
flame's PyTorch reference in float64 on the same inputs. The table goes into docs/performance.md between
``<!-- bench_dqkwg_<device> -->`` markers, written again after each shape and merged with the section there was
(``measure_and_write``: a run stopped part-way leaves the rows it made, each shape's with the run that measured it).
"""

import argparse
import functools
import math
import re
import sys
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
    no_cuda_gpu,
    section_in,
    write_section,
)

MARKER = "bench_dqkwg"
ANCHOR = "FLA TileLang"  # the row each row's time is compared with
# A run's line in a section ("- `command` (shapes A,B; 8 x 2048 tokens; date; torch; seconds)") and a table row's shape
RUN_LINE = re.compile(r"^- (`.+`) \(shapes ([^;]+); (\d+ x \d+ tokens); (.+)\)$")
ROW_SHAPE = re.compile(r"^\| (\d+x\d+x\d+) \|")
CHUNK = 64


def inputs(shape: str, batch: int, seq_len: int) -> tuple[tuple, dict]:
    """(q, k, v, do, h, dh) and the keyword arguments of one call at heads x K x V."""
    heads, key_dim, value_dim = (int(n) for n in shape.split("x"))
    chunks = batch * seq_len // CHUNK
    dev = "cuda"

    def draw(*size, scale=1.0):
        return (torch.randn(*size, device=dev) * scale).to(torch.bfloat16)

    tokens = (batch, seq_len, heads)
    q, k, w = draw(*tokens, key_dim), draw(*tokens, key_dim, scale=key_dim**-0.5), draw(*tokens, key_dim)
    v, do, dv = draw(*tokens, value_dim), draw(*tokens, value_dim), draw(*tokens, value_dim)
    h, dh = draw(1, chunks, heads, value_dim, key_dim), draw(1, chunks, heads, value_dim, key_dim)
    decay = -torch.rand(batch, seq_len // CHUNK, CHUNK, heads, device=dev) * 0.2
    g = decay.cumsum(2).view(batch, seq_len, heads)  # token-local within each chunk
    kwargs = dict(w=w, g=g, dv=dv, scale=key_dim**-0.5, state_v_first=True, chunk_size=CHUNK)
    return (q, k, v, do, h, dh), kwargs


def relative_error(got: tuple, want: tuple) -> float:
    ratios = [
        ((x.double() - ref).square().mean().sqrt() / ref.square().mean().sqrt()).item()
        for x, ref in zip(got, want)
        if ref is not None
    ]
    return max(ratios)


def implementations(settings: list[dict] | None) -> dict:
    """Row name -> call: flame's kernel autotuned, then pinned to each setting (None: each setting it tunes over),
    then FLA's TileLang kernel."""
    from flame.ops.gated_delta_rule import dqkwg_triton

    rows = {"flame Triton, autotuned": dqkwg_triton.chunk_bwd_dqkwg_triton}
    if settings is None:
        settings = [
            {"BK": dqkwg_triton.BLOCK_K, **c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
            for c in dqkwg_triton.TUNING_CONFIGS
        ]
    for launch in settings:
        text = "BK {BK}, BV {BV}, {num_warps} warps, {num_stages} stages".format(**launch)
        rows[f"flame Triton, {text}"] = functools.partial(dqkwg_triton.chunk_bwd_dqkwg_triton, launch=launch)
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    except ImportError:
        return rows
    backend = CommonTileLangBackend()
    if backend.is_available():
        rows[ANCHOR] = backend.chunk_bwd_dqkwg
    return rows


def chosen_setting() -> str:
    """The setting flame's autotuner chose for the last shape it tuned."""
    from flame.ops.gated_delta_rule import dqkwg_triton

    best = dqkwg_triton._dqkwg_kernel_tuned.best_config
    return ", ".join(f"{name} {value}" for name, value in best.kwargs.items()) + (
        f", {best.num_warps} warps, {best.num_stages} stages"
    )


def measure(
    shape: str, args: argparse.Namespace, settings: list[dict] | None
) -> list[tuple[str, float, float, str]]:
    """[(row name, ms, error, why the call was refused or '')] for one shape."""
    from flame.ops.gated_delta_rule.dqkwg_reference import chunk_bwd_dqkwg_torch

    tensors, kwargs = inputs(shape, args.batch, args.seq_len)
    f64 = {n: x.double() if torch.is_tensor(x) and x.is_floating_point() else x for n, x in kwargs.items()}
    want = chunk_bwd_dqkwg_torch(*(x.double() for x in tensors), **f64)
    rows = time_rows(shape, implementations(settings), tensors, kwargs, want, chosen_setting, args.rep)
    del want
    torch.cuda.empty_cache()
    return rows


def time_rows(shape, calls: dict, tensors, kwargs, want, chosen, rep) -> list[tuple[str, float, float, str]]:
    """Each call's time and error against ``want``; the autotuned row is named with ``chosen()``, the setting it
    chose (bench/recurrences.py's rows too)."""
    from triton.testing import do_bench_cudagraph

    rows = []
    for name, call in calls.items():
        try:
            got = call(*tensors, **kwargs)  # autotunes or compiles
        except Exception as error:  # a backend that refuses the call: the row says why
            rows.append(
                (name, math.nan, math.nan, f"{type(error).__name__}: {str(error).splitlines()[0][:80]}")
            )
            continue
        error = relative_error(got, want)
        if name.endswith("autotuned"):
            name = f"{name} ({chosen()})"
        ms = do_bench_cudagraph(lambda call=call: call(*tensors, **kwargs), rep=rep, return_mode="median")
        rows.append((name, ms, error, ""))
        print(f"{shape} {name}: {ms:.3f} ms, error {error:.1e}", flush=True)
    return rows


def table(results: dict, anchor_row: str = ANCHOR) -> str:
    """Each shape's rows with the anchor row's time over theirs (bench/recurrences.py's table too)."""
    lines = [
        f"| heads x K x V | implementation | ms | {anchor_row}'s time / row's | rel. RMS error vs float64 |",
        "|---|---|---:|---:|---:|",
    ]
    for shape, rows in results.items():
        anchor = next((ms for name, ms, _, _ in rows if name == anchor_row), math.nan)
        for name, ms, error, note in rows:
            if note:
                lines.append(f"| {shape} | {name} | {note} | | |")
                continue
            ratio = f"{anchor / ms:.2f}x" if not math.isnan(anchor) else ""
            lines.append(f"| {shape} | {name} | {ms:.3f} | {ratio} | {error:.1e} |")
    return "\n".join(lines)


def merged_with_section(old_section: str, run: str, new_rows: list[str]) -> tuple[list[str], list[str]]:
    """A section's run lines and table rows after ``run`` (its line) measured the shapes of ``new_rows``: those
    rows replace the shapes' earlier ones, and the earlier section's rows of other shapes stay, with the runs that
    measured them, where those runs had the same tokens. A section without run lines is replaced whole. Shapes
    keep their places in the earlier section's table, the ones new to it after them."""
    new_shapes = list(dict.fromkeys(ROW_SHAPE.match(row)[1] for row in new_rows))
    tokens = RUN_LINE.match(run)[3]
    old_runs = [
        match for line in old_section.splitlines() if (match := RUN_LINE.match(line)) and match[3] == tokens
    ]
    measured_before = {shape for match in old_runs for shape in match[2].split(",")}
    old_rows = [line for line in old_section.splitlines()
                if (match := ROW_SHAPE.match(line)) and match[1] in measured_before and match[1] not in new_shapes]  # fmt: skip
    kept = {ROW_SHAPE.match(row)[1] for row in old_rows}
    runs = []
    for match in old_runs:
        if shapes := [shape for shape in match[2].split(",") if shape in kept]:
            runs.append(f"- {match[1]} (shapes {','.join(shapes)}; {match[3]}; {match[4]})")
    old_order = [match[1] for line in old_section.splitlines() if (match := ROW_SHAPE.match(line))]
    order = {shape: index for index, shape in enumerate(dict.fromkeys(old_order + new_shapes))}
    # sorted() is stable: a shape's rows keep their order
    rows = sorted(old_rows + new_rows, key=lambda row: order[ROW_SHAPE.match(row)[1]])
    return runs + [run], rows


def section_text(old_section: str, run: str, table_text: str) -> tuple[str, str]:
    """(description, table) of a kernel bench's section after ``run`` made ``table_text``'s rows, merged with the
    section there was (merged_with_section)."""
    header, new_rows = table_text.splitlines()[:2], table_text.splitlines()[2:]
    runs, rows = merged_with_section(old_section, run, new_rows)
    description = "\n".join(
        [
            "Measured by these runs (the shapes of their rows; tokens; date; torch; seconds):",
            "",
            *runs,
            "",
            "bf16, the states stored [V, K]. Medians of triton.testing.do_bench_cudagraph (GPU time).",
        ]
    )
    return description, "\n".join(header + rows)


def measure_and_write(
    shapes: list[str], measure_shape, args, command: str, marker: str, title: str, anchor: str
) -> dict:
    """Each shape's rows (``measure_shape(shape)``), and unless ``--no_write`` the doc's section written again after
    each shape, merged with the section there was (section_text), so that a run stopped part-way leaves the rows it
    made (bench/recurrences.py's too). The results, shape -> rows. The autotuned rows tune as a training job does
    (tune_once_per_host, before the first shape imports a kernel), so their results stay in Triton's cache for
    ``scripts/autotune_bundle.py``."""
    from flame.ops.autotune import tune_once_per_host

    tune_once_per_host()
    started = time.perf_counter()
    old_section = section_in(args.doc.read_text(), marker) if args.doc.exists() else ""
    results = {}
    for shape in shapes:
        results[shape] = measure_shape(shape)
        if args.no_write:
            continue
        run = (f"- `{command}` (shapes {','.join(results)}; {args.batch} x {args.seq_len} tokens; "
               f"{time.strftime('%Y-%m-%d')}; torch {torch.__version__}; {time.perf_counter() - started:.0f} s)")  # fmt: skip
        description, text = section_text(old_section, run, table(results, anchor))
        write_section(args.doc, marker, title, description, text)
    return results


def launch_settings(text: str, names: tuple[str, ...]) -> list[dict]:
    """Launch settings from ``--settings`` text: comma-separated items of '/'-separated integers, one per name in
    ``names`` (bench/recurrences.py's too); ValueError for an item of another form."""
    settings = []
    for item in text.split(","):
        parts = item.split("/")
        if len(parts) != len(names) or not all(part.isdigit() for part in parts):
            raise ValueError(f"{item!r} is not {'/'.join(names)}")
        settings.append(dict(zip(names, map(int, parts))))
    return settings


def settings_argument(parser: argparse.ArgumentParser, args: argparse.Namespace, parse) -> None:
    """Replaces ``args.settings`` by ``parse(args.settings)``; a malformed value stops the parser with one line."""
    try:
        args.settings = parse(args.settings)
    except ValueError as error:
        parser.error(f"--settings: {error}")


def parse_settings(text: str | None) -> list[dict] | None:
    """``--settings`` as launch settings; None stands for the kernel's tuning settings, read where the rows are made:
    importing the kernel's module here would make its autotuner before measure_and_write has tuning results kept
    (TRITON_CACHE_AUTOTUNING), and scripts/autotune_bundle.py would find none of the run's."""
    return None if text is None else launch_settings(text, ("BK", "BV", "num_warps", "num_stages"))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", default="6x256x512,16x96x192,16x128x128", help="heads x K x V, comma separated"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048, help="a multiple of 64")
    parser.add_argument(
        "--settings", default=None, help="BK/BV/warps/stages, comma separated (default: every tuning setting)"
    )
    parser.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph repetitions, ms")
    add_doc_options(parser)
    args = parser.parse_args(argv)
    if args.seq_len % CHUNK:
        parser.error(f"--seq_len must be a multiple of {CHUNK}")
    settings_argument(parser, args, parse_settings)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if no_cuda_gpu("bench/dqkwg.py"):
        return 1
    device = device_name(torch.device("cuda"))
    results = measure_and_write(
        args.shapes.split(","),
        lambda shape: measure(shape, args, args.settings),
        args,
        command_line("bench/dqkwg.py", argv),
        f"{MARKER}_{device_slug(device)}",
        f"flame's dq/dk/dw/dg kernel per launch setting, {device}",
        ANCHOR,
    )
    print("\n" + table(results, ANCHOR))
    return 0


if __name__ == "__main__":
    sys.exit(main())
