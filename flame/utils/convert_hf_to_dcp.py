"""``python -m flame.utils.convert_hf_to_dcp``, upstream flame's name of ``python -m flame.cli.convert_hf_to_dcp``."""

import sys

from flame.cli.convert_hf_to_dcp import main

if __name__ == "__main__":
    sys.exit(main())
