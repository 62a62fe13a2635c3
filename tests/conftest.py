"""tests/gpu needs CUDA: it is collected only on a machine with a GPU (run it there: pytest tests/gpu).

``make_trainer`` (tests/trainer_helpers.py) builds flame's Trainer in-process for any test.
"""

import torch

from tests.trainer_helpers import make_trainer  # noqa: F401  (fixture)

collect_ignore = [] if torch.cuda.is_available() else ["gpu"]
