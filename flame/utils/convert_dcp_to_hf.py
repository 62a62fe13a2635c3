"""``python -m flame.utils.convert_dcp_to_hf``, upstream flame's name of ``python -m flame.cli.convert_dcp_to_hf``."""

import sys

from flame.cli.convert_dcp_to_hf import main

if __name__ == "__main__":
    sys.exit(main())
