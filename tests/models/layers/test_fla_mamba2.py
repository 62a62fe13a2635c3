"""flame.models.layers.fla_mamba2: FLA's Mamba2 layer with its training scan on flame.ops.ssd, against FLA's own
PyTorch path (``torch_forward``) on the CPU, float64 inputs and weights. FLA's path computes its scan in float32
whatever the input, in another order than flame's chunks: the two agree to float32's rounding (the largest
difference within 1e-4 of the tensor's largest value; up to 3.3e-5 measured, for A_log's gradient, a sum over every
token whose terms cancel); a wrong split, gate, skip or step differs at
order one. flame's scan
itself is checked in float64 against the recurrence (tests/ops/test_ssd.py). FLA's gated RMSNorm is a Triton kernel, so both layers get
the same PyTorch gated RMSNorm in its place, and FLA's Triton SiLU torch's (neither is what is compared)."""

import pytest
import torch
from torch import nn

pytest.importorskip("fla")

from fla.layers.mamba2 import Mamba2  # noqa: E402

from flame.models import build_model, model_args_from_dict  # noqa: E402
from flame.models.layers import fla_mamba2  # noqa: E402
from flame.models.layers.fla_mamba2 import FLAMamba2  # noqa: E402
from tests.models.layers.packed_documents import BOUNDS, assert_packed_equals_alone  # noqa: E402

FLOAT32_SCAN = 1e-4


def assert_scan_close(ours: torch.Tensor, reference: torch.Tensor, name: str = "") -> None:
    difference = (ours - reference).abs().max() / reference.abs().max()
    assert difference <= FLOAT32_SCAN, f"{name}: {difference:.1e} of the largest value"


class GatedRMSNorm(nn.Module):
    """FLA's RMSNormGated with norm_before_gate False: rmsnorm(y * silu(gate)) * weight, the mean of squares over
    each group of ``group_size`` channels (Mamba2 builds it with intermediate_size // n_groups)."""

    def __init__(self, weight: torch.Tensor, eps: float, group_size: int):
        super().__init__()
        self.weight, self.eps, self.group_size = weight, eps, group_size

    def forward(self, y, gate):
        y = y * nn.functional.silu(gate.to(y.dtype))
        groups = y.unflatten(-1, (-1, self.group_size))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return groups.flatten(-2) * self.weight


def layers(n_groups: int = 1, rmsnorm: bool = True):
    options = dict(hidden_size=24, head_dim=8, state_size=5, expand=2, n_groups=n_groups, chunk_size=16,
                   rmsnorm=rmsnorm)  # fmt: skip
    torch.manual_seed(0)
    fla_layer = Mamba2(**options).double()
    flame_layer = FLAMamba2(**options).double()
    flame_layer.load_state_dict(fla_layer.state_dict())
    with torch.no_grad():  # FLA leaves these to its model's initialisation: values of the trained range
        for layer in (fla_layer, flame_layer):
            layer.dt_bias.copy_(torch.linspace(-2.0, 1.0, layer.num_heads))
            layer.A_log.copy_(torch.linspace(0.0, 2.0, layer.num_heads))
            layer.act = nn.functional.silu
            if rmsnorm:
                layer.norm = GatedRMSNorm(
                    layer.norm.weight, layer.norm_eps, layer.intermediate_size // n_groups
                )
    return fla_layer, flame_layer


def test_the_gated_norm_stand_in_is_flas_reference_with_groups():
    """GatedRMSNorm (this file's CPU stand-in for FLA's Triton RMSNormGated) equals FLA's own reference function with
    the group size Mamba2 gives it (tests/gpu/test_fla_mamba2.py compares the Triton norm's layer against it)."""
    from fla.modules.layernorm_gated import rms_norm_ref

    torch.manual_seed(0)
    y, gate, weight = torch.randn(3, 7, 48, dtype=torch.float64), torch.randn(3, 7, 48), torch.randn(48)
    for group_size in (48, 24, 12):
        ours = GatedRMSNorm(weight.double(), 1e-5, group_size)(y, gate)
        reference = rms_norm_ref(
            y, weight, None, z=gate, eps=1e-5, group_size=group_size, norm_before_gate=False
        )
        torch.testing.assert_close(ours, reference.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rmsnorm", [True, False])
def test_training_forward_and_gradients_equal_flas_pytorch_path(rmsnorm):
    """37 tokens (FLA pads them to its 16-token chunks; flame chunks by 64): output and every parameter's and the
    input's gradient, with and without the gated norm."""
    fla_layer, flame_layer = layers(rmsnorm=rmsnorm)
    x = torch.randn(2, 37, 24, dtype=torch.float64)
    grad = torch.randn(2, 37, 24, dtype=torch.float64)
    results = []
    for layer in (fla_layer, flame_layer):
        leaf = x.clone().requires_grad_()
        out = layer(leaf)[0]
        out.backward(grad)
        results.append((out, leaf.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (fla_out, fla_dx, fla_grads), (out, dx, grads) = results
    assert_scan_close(out, fla_out, "output")
    assert_scan_close(dx, fla_dx, "input gradient")
    assert grads.keys() == fla_grads.keys()
    for name in grads:
        assert_scan_close(grads[name], fla_grads[name], name)


@pytest.mark.parametrize("n_groups", [1, 2])
def test_packed_documents_equal_each_document_alone(n_groups):
    """cu_seqlens: one row of three documents (one of a single token, one past a 16-token chunk) gives each
    document's output and the gradients of the documents run one by one through flame's layer, within 1e-6 of the
    largest value (the layer scans in float32, as FLA's: the documents' chunks differ from the row's; documents that
    saw each other would differ at order one); a cache with packed documents is refused."""
    _, ours = layers(n_groups=n_groups)
    assert_packed_equals_alone(ours, 24, limit=1e-6)
    with pytest.raises(ValueError, match="without a cache only"):
        ours(torch.randn(1, 37, 24, dtype=torch.float64), cu_seqlens=BOUNDS, use_cache=True)


def test_heads_read_their_groups_b_and_c_as_mamba_ssm_does(monkeypatch):
    """With 2 groups of 3 heads, heads 0-2 read group 0's B and C and heads 3-5 group 1's (mamba_ssm's layout)."""
    _, layer = layers(n_groups=2, rmsnorm=False)
    seen, ssd = {}, fla_mamba2.ssd

    def recording_ssd(x, dt, A, B, C, cu_seqlens=None):
        seen["B"], seen["C"] = B, C
        return ssd(x, dt, A, B, C, cu_seqlens=cu_seqlens)

    monkeypatch.setattr(fla_mamba2, "ssd", recording_ssd)
    layer(torch.randn(1, 9, 24, dtype=torch.float64))
    for name in ("B", "C"):
        per_head = seen[name]
        assert per_head.shape[2] == 6
        for head in range(6):
            torch.testing.assert_close(per_head[:, :, head], per_head[:, :, 3 * (head // 3)], rtol=0, atol=0)
        assert not torch.equal(per_head[:, :, 0], per_head[:, :, 3])


@pytest.mark.parametrize("n_groups", [1, 2])
def test_prefill_continues_into_flas_decoding_step(n_groups):
    """A prompt's prefill keeps the cache FLA's decoding step reads (the convolution's last inputs, the scan's last
    state): prefill of 36 tokens then FLA's step for the 37th gives the 37th output of the whole sequence's forward,
    for one and for two groups of B and C (float64 inputs, the scans in float32 on both sides: within 1e-6 relative,
    4.8e-7 measured; heads reading the wrong group would differ at order one)."""
    _, layer = layers(n_groups=n_groups)
    x = torch.randn(2, 37, 24, dtype=torch.float64)
    with torch.no_grad():
        whole = layer.torch_forward(x, None, False, None)[0]
        _, conv_state, ssm_state = layer.torch_forward(x[:, :-1], None, True, None)
        cache = {"conv_state": conv_state, "recurrent_state": ssm_state}
        last = layer.torch_forward(x[:, -1:], cache, True, None)[0]
    assert conv_state.shape == (2, layer.conv_dim, layer.conv_kernel_size)
    torch.testing.assert_close(last[:, 0], whole[:, -1], rtol=1e-6, atol=1e-7)


def test_generic_mamba2_builds_flames_layer_with_flas_state_dict():
    """mamba2 through the generic family (no mamba_ssm here) builds FLAMamba2 layers; FLA's class, built outside
    flame, keeps FLA's; the state dicts have the same keys, shapes and dtypes."""
    config = {"model_type": "mamba2", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16,
              "state_size": 8}  # fmt: skip
    model, reference = flame_and_fla_models(config)
    assert sum(isinstance(m, FLAMamba2) for m in model.modules()) == 2
    assert not any(isinstance(m, FLAMamba2) for m in reference.modules())
    assert state_dict_layout(model) == state_dict_layout(reference)


def flame_and_fla_models(config: dict) -> tuple[nn.Module, nn.Module]:
    """On the meta device: the generic family's model of ``config``, and FLA's class built outside flame."""
    from transformers import AutoConfig, AutoModelForCausalLM

    args, _ = model_args_from_dict(config)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        return build_model(args), AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config["model_type"], **fields)
        )


def state_dict_layout(model: nn.Module) -> dict:
    """Each state-dict key's shape and dtype."""
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
