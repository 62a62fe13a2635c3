"""Command-line tools, each run as ``python -m flame.cli.<name>`` (or ``python -m flame.utils.<name>``, upstream
flame's spelling): ``convert_dcp_to_hf``, ``convert_hf_to_dcp``,
``generate``, ``preprocess``, and ``download_checkpoint`` (also ``python download_checkpoint.py``, the softpick
fork's spelling). A mistake in the input is one line ``error: <message>`` on stderr and exit code 2."""

import sys
from collections.abc import Callable

from flame.errors import FlameError

EXIT_BAD_INPUT = 2


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """Run a tool's main, turning a FlameError into one line and exit code 2."""
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except FlameError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
