"""FLA's TileLang chunk_bwd_dqkwg, which FLA ranks ahead of its Triton kernel on Hopper where tilelang and nvcc
are installed, and which serves the gated calls there where FLA's Triton kernel is not refused (Triton >= 3.7.1;
below it flame ranks its own Triton kernel first: flame.compat.serve_gated_dqkwg_on_hopper), against the float64
PyTorch reference: test_dqkwg_triton.py's cases and limits in bf16 (TileLang's kernel takes the state in the
inputs' dtype, and the state's gradient too, as FLA's backward passes it)."""

import pytest
import torch

from tests.gpu.test_dqkwg_triton import CASES, check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("tilelang")


@pytest.mark.parametrize(("key_dim", "value_dim", "heads", "v_heads", "shape", "v_first", "with_w"), CASES)
def test_tilelang_kernel_matches_pytorch(key_dim, value_dim, heads, v_heads, shape, v_first, with_w):
    from fla.ops.common.backends.tilelang import CommonTileLangBackend

    backend = CommonTileLangBackend()
    if not backend.is_available():
        pytest.skip("FLA's TileLang backend is not available here (tilelang without nvcc)")
    check(
        key_dim,
        value_dim,
        heads,
        v_heads,
        shape,
        v_first,
        with_w,
        torch.bfloat16,
        None,
        backend.chunk_bwd_dqkwg,
        dh_dtype=torch.bfloat16,
    )
