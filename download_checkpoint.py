"""``python download_checkpoint.py --repo_id <owner/name> --experiment_checkpoint_folder <dump_folder>``: the softpick
fork's tool, as its users type it (flame/cli/download_checkpoint.py)."""

import sys

from flame.cli.download_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
