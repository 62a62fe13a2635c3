"""flame's Triton kernels on the CPU: tests/ops/interpreted runs in a subprocess under Triton's interpreter.

`triton.jit` (including triton.language's own jit functions such as tl.sum) picks the interpreter only when
TRITON_INTERPRET=1 is set before triton is imported, so those tests need a fresh process; tests/conftest.py
keeps them out of the normal session.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ops/interpreted"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
