"""GPU tests' fixtures. FLA's Triton kernels run one valid config here (the first that their own pruning keeps)
instead of autotuning: on a fresh machine FLA compiles and times every config of every kernel for each new shape
and flag set, and two time-boxed calls (2026-11-28, 420 s and 290 s) got through only two or three cases of
test_fla_library.py's gated delta rule. What these tests check (flame's wiring of FLA's kernels, the kernels against the PyTorch path) holds
for any valid config; ``FLAME_GPU_TESTS_TUNE=1`` tunes them as training does. flame's own kernels keep their
autotuning."""

import os

import pytest
import torch

from flame.ops.autotune import fla_kernels_on_first_config

FULL_TUNING = os.environ.get("FLAME_GPU_TESTS_TUNE") == "1"


@pytest.fixture(scope="package", autouse=True)
def fla_kernels_untuned():
    if FULL_TUNING or not torch.cuda.is_available():
        yield
        return
    with fla_kernels_on_first_config():
        yield


@pytest.fixture
def exact_float32(monkeypatch):
    """float32 math in full precision on the GPU: torch's matmuls without TF32, and Triton's ``tl.dot`` on float32
    inputs in IEEE float32 (``TRITON_F32_DEFAULT``: FLA's kernels leave the precision to Triton's default, TF32,
    whose 10-bit mantissa rounds each product at ~5e-4 relative). Kernels compile anew for it (the precision is part
    of their cache key)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")


@pytest.fixture
def fla_tilelang_off(monkeypatch):
    """FLA's TileLang kernels turned off (FLA_TILELANG=0, which FLA's backend registry reads at every call), so that
    Triton kernels serve and ``exact_float32`` reaches all of them: TileLang is not Triton, and TRITON_F32_DEFAULT
    does not set its precision. On an H200 (2026-12-02), with tilelang installed, FLA's TileLang chunk_bwd_dqkwg
    served the float32 backward of Mamba-2's scan and left the gradients of dt and A at up to 1.1e-2 relative RMS
    error (tests/gpu/test_ssd.py), where without tilelang flame's Triton kernel with IEEE products kept every
    tensor of a case of the same test within 1e-5."""
    monkeypatch.setenv("FLA_TILELANG", "0")
