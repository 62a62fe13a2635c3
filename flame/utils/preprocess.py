"""``python -m flame.utils.preprocess``, upstream flame's name of ``python -m flame.cli.preprocess``."""

import sys

from flame.cli.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
