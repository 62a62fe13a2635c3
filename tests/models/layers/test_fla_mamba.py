"""flame.models.layers.fla_mamba: FLA's Mamba layer (Mamba's first version) with its scan on flame's selective scan,
against FLA's own PyTorch path (``slow_forward``) on the CPU, float64 inputs and weights. FLA's path forms
exp(delta A) in float32 whatever the input (A is float32) and rounds the state to the input's dtype for C's product;
on the CPU flame's scan runs in float64 for float64 inputs: the two agree to float32's rounding (the largest
difference within 1e-5 of the tensor's largest value), where a wrong split, gate, skip or step differs at order one.
flame's scan itself is checked in float64 against a closed form (tests/ops/test_selective_scan.py) and its Triton
kernel against the recurrence (tests/ops/interpreted/test_selective_scan_triton.py)."""

import pytest
import torch
from torch import nn

pytest.importorskip("fla")

from fla.layers.mamba import Mamba  # noqa: E402

from flame.models import build_model, model_args_from_dict  # noqa: E402
from flame.models.layers.fla_mamba import FLAMamba  # noqa: E402
from tests.models.layers.packed_documents import BOUNDS, assert_packed_equals_alone  # noqa: E402
from tests.models.layers.test_fla_mamba2 import flame_and_fla_models, state_dict_layout  # noqa: E402

FLOAT32 = 1e-5


def assert_close_to_float32(ours: torch.Tensor, reference: torch.Tensor, name: str = "") -> None:
    difference = (ours - reference).abs().max() / reference.abs().max()
    assert difference <= FLOAT32, f"{name}: {difference:.1e} of the largest value"


def layers():
    options = dict(hidden_size=24, state_size=5, conv_kernel=4, intermediate_size=37, dt_rank=3, use_bias=True,
                   backend="triton")  # fmt: skip
    torch.manual_seed(0)
    fla_layer = Mamba(**options).double()
    flame_layer = FLAMamba(**options).double()
    flame_layer.load_state_dict(fla_layer.state_dict())
    with torch.no_grad():  # values of the trained range rather than the initial ones
        for layer in (fla_layer, flame_layer):
            layer.D.copy_(torch.linspace(-1.0, 1.0, 37))
    for layer in (fla_layer, flame_layer):
        layer.act = nn.functional.silu
    return fla_layer, flame_layer


@pytest.mark.parametrize("masked", [False, True])
def test_training_forward_and_gradients_equal_flas_pytorch_path(masked):
    """Output, the input's and every parameter's gradient, 29 tokens, with and without an attention mask (left
    padding of one row)."""
    fla_layer, flame_layer = layers()
    x = torch.randn(2, 29, 24, dtype=torch.float64)
    grad = torch.randn(2, 29, 24, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.ones(2, 29, dtype=torch.float64)
        mask[1, :6] = 0
    results = []
    for layer in (fla_layer, flame_layer):
        leaf = x.clone().requires_grad_()
        out = layer.slow_forward(leaf, None, False, mask)[0]
        out.backward(grad)
        results.append((out, leaf.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (fla_out, fla_dx, fla_grads), (out, dx, grads) = results
    assert_close_to_float32(out, fla_out, "output")
    assert_close_to_float32(dx, fla_dx, "input gradient")
    assert grads.keys() == fla_grads.keys()
    for name in grads:
        assert_close_to_float32(grads[name], fla_grads[name], name)


def test_prefill_keeps_flas_cache_and_continues_into_flas_decoding_step():
    """A prompt's prefill returns the cache FLA's does (the convolution's last inputs, the scan's last state), and
    FLA's decoding step from it gives the next output of the whole sequence's forward."""
    fla_layer, layer = layers()
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    with torch.no_grad():
        whole = layer.slow_forward(x, None, False, None)[0]
        _, conv_state, ssm_state = layer.slow_forward(x[:, :-1], None, True, None)
        _, fla_conv_state, fla_ssm_state = fla_layer.slow_forward(x[:, :-1], None, True, None)
        cache = {"conv_state": conv_state, "recurrent_state": ssm_state}
        last = layer.slow_forward(x[:, -1:], cache, True, None)[0]
    torch.testing.assert_close(conv_state, fla_conv_state, rtol=0, atol=0)
    assert ssm_state.dtype == fla_ssm_state.dtype and ssm_state.shape == (2, 37, 5)
    assert_close_to_float32(ssm_state, fla_ssm_state, "state")
    torch.testing.assert_close(last[:, 0], whole[:, -1], rtol=1e-10, atol=1e-12)


def test_generic_mamba_builds_flames_layer_with_flas_state_dict():
    """mamba through the generic family (no mamba_ssm here) builds FLAMamba layers; FLA's class, built outside
    flame, keeps FLA's; the state dicts have the same keys, shapes and dtypes."""
    config = {
        "model_type": "mamba",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "state_size": 8,
    }
    model, reference = flame_and_fla_models(config)
    assert sum(isinstance(m, FLAMamba) for m in model.modules()) == 2
    assert not any(isinstance(m, FLAMamba) for m in reference.modules())
    assert state_dict_layout(model) == state_dict_layout(reference)


def test_generic_samba_builds_flames_mamba_layers():
    """samba's Mamba layers are FLA's Mamba class too: flame builds FLAMamba for each (its attention layers are
    flame's FLAAttention, tests/models/generic/test_fla_families.py)."""
    config = {"model_type": "samba", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "state_size": 8,
              "attn": {"layers": [1], "num_heads": 4}}  # fmt: skip
    args, _ = model_args_from_dict(config)
    with torch.device("meta"):
        model = build_model(args)
    assert sum(isinstance(m, FLAMamba) for m in model.modules()) == 2


def test_packed_documents_equal_each_document_alone():
    """cu_seqlens: one row of three documents (one of a single token) gives each document's output and the
    gradients of the documents run one by one through flame's layer, float64 inputs, within 1e-6 of the largest
    value (the layer forms A = -exp(A_log) in float32, as FLA's: A_log's gradient, summed over the documents in
    another order, differs at float32's rounding; documents that saw each other differ at order one); a cache with
    packed documents is refused."""
    _, ours = layers()
    assert_packed_equals_alone(ours, 24, limit=1e-6)
    with pytest.raises(ValueError, match="without a cache only"):
        ours(torch.randn(1, 37, 24, dtype=torch.float64), cu_seqlens=BOUNDS, use_cache=True)
