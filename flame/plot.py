"""Curves of one or several runs, read from their TensorBoard event files, drawn into one PNG.

    python -m flame.plot exp/softpick exp/vanilla --out curves.png
    python -m flame.plot exp/run --metrics loss/train,loss/validation,lr --smooth 0.9 --out run.png

A run is any folder holding event files (a dump folder: its ``tb/<date>/`` subfolders, one per launch, are merged
in order, a later launch overriding the steps it repeats after a resume). One panel per metric, one line per run.
Needs matplotlib: ``pip install 'flame[plot]'``.
"""

import argparse
import math
import sys
from pathlib import Path

DEFAULT_METRICS = (
    "loss/train",
    "loss/validation",
    "lr",
    "grad_norm",
    "throughput/tokens_per_second_per_device",
)


class PlotError(Exception):
    pass


def read_scalars(run: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the event files under ``run``."""
    return {
        tag: {step: value for step, (_, value) in events.items()}
        for tag, events in read_scalar_events(run).items()
    }


def read_scalar_events(run: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """{tag: {step: (wall time, value)}} of every scalar in the event files under ``run``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = sorted({path.parent for path in run.rglob("events.out.tfevents.*")})
    if not folders:
        raise PlotError(f"no TensorBoard event files under {run}")
    scalars: dict[str, dict[int, tuple[float, float]]] = {}
    for folder in folders:
        accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update(
                {e.step: (e.wall_time, e.value) for e in accumulator.Scalars(tag)}
            )
    return scalars


def smoothed(values: list[float], weight: float) -> list[float]:
    """TensorBoard's exponential moving average (weight 0: unchanged), debiased at the start."""
    if weight <= 0:
        return values
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**i))
    return out


def run_labels(runs: list[Path]) -> list[str]:
    """Folder names, or the paths where two runs share a name."""
    names = [run.resolve().name for run in runs]
    return names if len(set(names)) == len(names) else [str(run) for run in runs]


def plot(runs: list[Path], metrics: list[str], out: Path, smooth: float = 0.0) -> list[str]:
    """Draw the PNG; returns the metrics drawn (those that at least one run logged)."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError(
            "flame.plot needs matplotlib: pip install 'flame[plot]' (or pip install matplotlib)"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [read_scalars(run) for run in runs]
    drawn = [metric for metric in metrics if any(metric in scalars for scalars in data)]
    if not drawn:
        raise PlotError(f"none of the runs logged {', '.join(metrics)}")
    columns = min(2, len(drawn))
    rows = math.ceil(len(drawn) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 3.8 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, drawn):
        for label, scalars in zip(run_labels(runs), data):
            if metric in scalars:
                steps = sorted(scalars[metric])
                values = smoothed([scalars[metric][s] for s in steps], smooth)
                marker = "o" if len(steps) <= 30 else None  # sparse series (validation) stay visible
                ax.plot(steps, values, label=label, linewidth=1.2, marker=marker, markersize=3)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if metric.startswith("loss/") or metric == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        ax.legend(fontsize="small")
    for ax in axes.flat[len(drawn) :]:
        ax.set_visible(False)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flame.plot", description=__doc__.split("\n")[0])
    parser.add_argument(
        "runs", nargs="+", type=Path, help="run folders (dump folders or TensorBoard folders)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("curves.png"), help="PNG to write (default curves.png)"
    )
    parser.add_argument(
        "--metrics",
        default=",".join(DEFAULT_METRICS),
        help=f"comma-separated scalar tags (default {','.join(DEFAULT_METRICS)})",
    )
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) as in TensorBoard")
    args = parser.parse_args(argv)
    try:
        if not 0 <= args.smooth < 1:
            raise PlotError(f"--smooth must be in [0, 1), got {args.smooth}")
        for run in args.runs:
            if not run.is_dir():
                raise PlotError(f"run folder {run} does not exist")
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        drawn = plot(args.runs, metrics, args.out, args.smooth)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
