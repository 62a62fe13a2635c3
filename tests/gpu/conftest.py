import pytest
import torch


@pytest.fixture
def exact_float32(monkeypatch):
    """float32 math in full precision on the GPU: torch's matmuls without TF32, and Triton's ``tl.dot`` on float32
    inputs in IEEE float32 (``TRITON_F32_DEFAULT``: FLA's kernels leave the precision to Triton's default, TF32,
    whose 10-bit mantissa rounds each product at ~5e-4 relative). Kernels compile anew for it (the precision is part
    of their cache key)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
