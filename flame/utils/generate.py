"""``python -m flame.utils.generate``, upstream flame's name of ``python -m flame.cli.generate``."""

import sys

from flame.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
