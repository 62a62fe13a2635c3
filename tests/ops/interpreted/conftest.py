"""Tests here run under Triton's CPU interpreter (TRITON_INTERPRET=1, see tests/ops/test_triton_kernels_interpreted.py)."""

import pytest
from triton.runtime import interpreter


@pytest.fixture(autouse=True)
def interpreter_scalar_index(monkeypatch):
    """Triton 3.6's interpreter holds scalars as NumPy arrays of shape (1,) and turns them into loop bounds with
    int(array), which NumPy >= 2.4 refuses; .item() accepts them. Only affects loops with runtime bounds."""
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
