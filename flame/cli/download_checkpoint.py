"""Download a run's checkpoints from a hub repository into its dump folder, to resume the run there.

    python download_checkpoint.py --repo_id <owner/name> --experiment_checkpoint_folder <dump_folder> [--step N ...]
    python -m flame.cli.download_checkpoint ...   (the same)

The softpick fork's tool, with its flags: the repository's ``step-<N>/`` folders (``--checkpoint.hf_upload_enabled``)
go to ``<dump_folder>/checkpoint/step-<N>``, and ``bash train.sh --job.dump_folder <dump_folder> ...`` then resumes
from the newest. Each step is verified before it is added, and steps already there are kept
(flame.checkpoint.hub_download). The token is the machine's (``hf auth login``, or HF_TOKEN); HF_ENDPOINT is read.
"""

import argparse
import sys
from pathlib import Path

from flame.checkpoint.hub_download import download_checkpoints
from flame.cli import run_cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python download_checkpoint.py", description=__doc__.split("\n")[0])
    parser.add_argument("--repo_id", required=True, help="the hub repository the run uploaded to: owner/name")
    parser.add_argument(
        "--experiment_checkpoint_folder",
        required=True,
        help="the run's dump folder (--job.dump_folder); its checkpoint folder receives the steps",
    )
    parser.add_argument(
        "--step",
        type=int,
        nargs="+",
        help="only these steps (-1: the newest); default: every step in the repository",
    )
    parser.add_argument(
        "--folder", default="checkpoint", help="the run's --checkpoint.folder (default checkpoint)"
    )
    return parser.parse_args(argv)


def download(argv: list[str]) -> int:
    options = parse(argv)
    folder = Path(options.experiment_checkpoint_folder) / options.folder
    folder.mkdir(parents=True, exist_ok=True)
    added = download_checkpoints(options.repo_id, folder, options.step)
    if added:
        print(
            f"Added {', '.join(f'step-{s}' for s in added)} to {folder}; resume with: bash train.sh "
            f"--job.dump_folder {options.experiment_checkpoint_folder} ..."
        )
    else:
        print(f"Nothing added to {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(download, argv)


if __name__ == "__main__":
    sys.exit(main())
