"""tests/gpu needs CUDA: it is collected only on a machine with a GPU (run it there: pytest tests/gpu)."""

import torch

collect_ignore = [] if torch.cuda.is_available() else ["gpu"]
