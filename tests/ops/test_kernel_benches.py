"""The kernel benches (bench/*.py that time Triton kernels) on a machine without a GPU: one line saying so, exit 1."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
@pytest.mark.parametrize("script", ["bench/softpick_kernel.py", "bench/attention_delta.py", "bench/ssd.py"])
def test_a_kernel_bench_says_it_needs_a_gpu(script):
    result = subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"{script} needs a CUDA GPU (the kernels are Triton); none is visible"
    ]
