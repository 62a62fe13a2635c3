"""``python -m flame.checkpoint verify <dump_folder> [--no-checksums]``: check every checkpoint of a run.

One line per step directory (``ok``, or what is wrong with it), then which step a resumed run would load. Exit
status 0 when every complete checkpoint verifies, 1 when one does not, 2 for a path that holds no checkpoint folder.
"""

import argparse
import sys

from flame.checkpoint.layout import CheckpointError, checkpoint_folder, list_steps, partial_dir, step_dir
from flame.checkpoint.verify import checkpoint_problem


def verify(path: str, checksums: bool) -> int:
    folder = checkpoint_folder(path)
    steps = list_steps(folder)
    newest_good, bad = None, 0
    for step, complete in sorted(steps.items()):
        if not complete:
            where = step_dir(folder, step) if step_dir(folder, step).is_dir() else partial_dir(folder, step)
            print(f"{where}: interrupted save (never loaded)")
            continue
        problem = checkpoint_problem(step_dir(folder, step), checksums)
        print(f"{step_dir(folder, step)}: {problem or 'ok'}")
        if problem:
            bad += 1
        else:
            newest_good = step
    if newest_good is None:
        print(f"{folder}: no checkpoint verifies; a new run there starts from scratch")
    else:
        print(f"a resumed run loads step-{newest_good}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flame.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="check every checkpoint of a dump folder")
    check.add_argument("path", help="a dump folder, or its checkpoint folder")
    check.add_argument("--no-checksums", action="store_true", help="check sizes and metadata only")
    args = parser.parse_args(argv)
    try:
        return verify(args.path, checksums=not args.no_checksums)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
