"""Add a tuned Triton cache's autotuning results to flame's shipped bundle for that GPU (flame/assets/autotune/).

    python scripts/autotune_bundle.py                          # on the GPU machine, after a run tuned its kernels
    python scripts/autotune_bundle.py tune.tar.gz --device "NVIDIA H200" --triton 3.6.0   # a cache brought back

Sources are Triton cache folders (default: TRITON_CACHE_DIR, else Triton's own) or .tar.gz archives of one. Run
on a machine where nothing else shared the GPUs while the kernels were tuned: the bundle's choices become every
fresh machine's (flame.ops.autotune.seed_shipped_results). Entries that the bundles of the GPU's chip siblings
seeded into the cache (the same result, not tuned on this GPU) are left out: the bundle holds this GPU's choices.
"""

import argparse
import sys
import tarfile
import tempfile
from pathlib import Path

from flame.ops.autotune import SHIPPED_DIR, bundle_path, collect_results, sibling_entries, write_bundle


def results_of(source: Path) -> dict[str, dict]:
    if source.is_dir():
        return collect_results(source)
    with tempfile.TemporaryDirectory() as folder, tarfile.open(source) as archive:
        archive.extractall(folder, filter="data")
        return collect_results(Path(folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sources", nargs="*", type=Path, help="Triton cache folders or .tar.gz archives of one"
    )
    parser.add_argument("--device", default=None, help="the GPU model (default: torch's name of GPU 0)")
    parser.add_argument(
        "--triton", default=None, help="the Triton version that tuned (default: the installed one)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the bundle (default: the device's in flame/assets)"
    )
    parser.add_argument(
        "--shipped", type=Path, default=SHIPPED_DIR, help="the bundles whose seeded entries are left out"
    )
    args = parser.parse_args(argv)
    if args.device is None or args.triton is None or not args.sources:
        import torch
        import triton
        from triton import knobs

        if args.device is None and not torch.cuda.is_available():
            parser.error("no GPU here: give --device, the name of the GPU that tuned the cache")
        args.device = args.device or torch.cuda.get_device_name(0)
        args.triton = args.triton or triton.__version__
        args.sources = args.sources or [Path(knobs.cache.dir)]
    missing = [str(source) for source in args.sources if not source.exists()]
    if missing:
        parser.error(f"no such cache folder or archive: {', '.join(missing)}")
    results = {}
    for source in args.sources:
        results.update(results_of(source))
    seeded = sibling_entries(args.device, args.triton, args.shipped)
    copied = [name for name, result in results.items() if seeded.get(name) == result]
    for name in copied:
        del results[name]
    if not results:
        seeded_only = f" ({len(copied)} seeded from its chip's other bundles)" if copied else ""
        parser.error(
            "no autotuning results tuned on this GPU that chose among configurations in "
            f"{', '.join(map(str, args.sources))}{seeded_only}"
        )
    out = args.out or bundle_path(args.device, args.shipped)
    total = write_bundle(out, args.device, args.triton, results)
    left_out = f"; {len(copied)} left out, seeded from its chip's other bundles" if copied else ""
    print(
        f"{out}: {len(results)} results read, {total} in all ({args.device}, Triton {args.triton}){left_out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
