"""flame.models.layers.fla_log_linear_mamba2: FLA's LogLinearMamba2 layer with packed documents, on the CPU in
float64, against FLA's own training path (``hmamba_split_conv1d_scan_combined``, the function its CUDA forward
checkpoints) with its Triton pieces given PyTorch ones: the log-linear op FLA's reference (``naive_log_linear_attn``,
which flame's layer also runs off CUDA), the convolution torch's, the gated RMSNorm FLA's reference
(``rms_norm_ref``). Outputs and every gradient within 1e-12 of the largest value (float64 both sides; a wrong split,
step, scale, skip or gate differs at order one)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("fla")

import fla.layers.log_linear_mamba2 as fla_layer_module  # noqa: E402
from fla.modules.layernorm_gated import rms_norm_ref  # noqa: E402
from fla.ops.log_linear_attn.naive import naive_log_linear_attn  # noqa: E402

from flame.models import build_model, model_args_from_dict  # noqa: E402
from flame.models.layers.fla_log_linear_mamba2 import FLALogLinearMamba2  # noqa: E402
from tests.models.layers.packed_documents import assert_packed_equals_alone  # noqa: E402

WIDTH = 24


class ReferenceGatedNorm(nn.Module):
    """FLA's RMSNormGated (a Triton kernel) as FLA's PyTorch reference, same weight, eps, group size, gate order."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        self.group_size, self.norm_before_gate = norm.group_size, norm.norm_before_gate

    def forward(self, y, gate):
        return rms_norm_ref(y, self.weight, None, z=gate, eps=self.eps, group_size=self.group_size,
                            norm_before_gate=self.norm_before_gate, upcast=False)  # fmt: skip


def layer(**options) -> FLALogLinearMamba2:
    torch.manual_seed(0)
    options = {"num_heads": 3, "head_dim": 4, "hidden_size": WIDTH, "state_size": 5, "expand": 0.5, **options}
    ours = FLALogLinearMamba2(**options).double()
    with torch.no_grad():  # values of the trained range where FLA's layer leaves them constant
        ours.A_log.copy_(torch.linspace(-1.0, 1.0, ours.num_heads))
        ours.L.copy_(torch.rand_like(ours.L) + 0.5)
        ours.D.copy_(torch.randn_like(ours.D))
        if ours.rmsnorm:
            ours.norm.weight.copy_(torch.randn_like(ours.norm.weight))
    ours.act = nn.SiLU()
    if ours.rmsnorm:
        ours.norm = ReferenceGatedNorm(ours.norm)
    return ours


def flas_training_path(ours: FLALogLinearMamba2, hidden: torch.Tensor) -> torch.Tensor:
    """What FLA's CUDA forward computes in training, its Triton calls swapped for PyTorch ones."""

    def scan(q, k, v, g, level_scales, **kwargs):
        return naive_log_linear_attn(q, k, v, g, level_scales, scale=kwargs["scale"]), None

    def conv(x, weight, bias, activation, seq_idx):
        y = F.conv1d(
            x.transpose(1, 2), weight[:, None], bias, padding=weight.shape[-1] - 1, groups=x.shape[-1]
        )
        return F.silu(y[..., : x.shape[1]]).transpose(1, 2), None

    def rmsnorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate):
        return rms_norm_ref(x, weight, bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate,
                            upcast=False)  # fmt: skip

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fla_layer_module, "chunk_log_linear_attn", scan)
        patch.setattr(fla_layer_module, "rmsnorm_fn", rmsnorm_fn)
        return fla_layer_module.hmamba_split_conv1d_scan_combined(
            ours.in_proj(hidden),
            ours.conv1d.weight[:, 0],
            ours.conv1d.bias,
            ours.dt_bias,
            -torch.exp(ours.A_log.float()),
            ours.L,
            ours._get_D(),
            ours.chunk_size,
            rmsnorm_weight=ours.norm.weight if ours.rmsnorm else None,
            rmsnorm_eps=ours.norm.eps if ours.rmsnorm else 1e-6,
            outproj_weight=ours.out_proj.weight,
            outproj_bias=ours.out_proj.bias,
            headdim=None if ours.D_has_hdim else ours.head_dim,
            ngroups=ours.n_groups,
            norm_before_gate=ours.norm_before_gate,
            conv1d_fn=conv,
            conv_backend="triton",
        )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"rmsnorm": False},
        {"D_has_hdim": True, "use_conv_bias": True},
        {"n_groups": 3, "norm_before_gate": True},
    ],
    ids=["default", "no_norm", "per_channel_skip", "groups"],
)
def test_the_layer_computes_flas_training_path(options):
    ours = layer(**options)
    hidden = torch.randn(2, 37, WIDTH, dtype=torch.float64)
    grad = torch.randn(2, 37, WIDTH, dtype=torch.float64)
    results = []
    for forward in (lambda h: ours(h)[0], lambda h: flas_training_path(ours, h)):
        ours.zero_grad()
        leaf = hidden.clone().requires_grad_()
        out = forward(leaf)
        out.backward(grad)
        results.append({"output": out, "input": leaf.grad, **{n: p.grad for n, p in ours.named_parameters()}})
    for name, expected in results[1].items():
        difference = (results[0][name] - expected).abs().max() / expected.abs().max()
        assert difference <= 1e-12, f"{name}: {difference:.1e} of the largest value"


@pytest.mark.parametrize("options", [{}, {"n_groups": 3}], ids=["default", "groups"])
def test_packed_documents_equal_each_document_alone(options):
    """cu_seqlens: one row of three documents (one of a single token) gives each document's output and the
    gradients of the documents run one by one, float64, within 1e-7 of the largest value: A_log's gradient is summed
    in float32 (FLA's layer computes A from ``A_log.float()``), in another order for the packed row (9e-9 measured);
    a document reading its neighbour differs at order one."""
    assert_packed_equals_alone(layer(**options), WIDTH, limit=1e-7)


def test_a_cache_with_packed_documents_is_refused():
    from fla.models.cache_utils import Cache

    hidden = torch.randn(1, 5, WIDTH, dtype=torch.float64)
    with pytest.raises(ValueError, match="LogLinearMamba2 takes packed documents .* without a cache"):
        layer(layer_idx=0)(
            hidden, past_key_values=Cache(), use_cache=True, cu_seqlens=torch.tensor([0, 2, 5])
        )


def test_generic_log_linear_mamba2_builds_flames_layer_with_flas_state_dict():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"model_type": "log_linear_mamba2", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
              "head_dim": 16, "num_heads": 4, "state_size": 64}  # fmt: skip
    args, _ = model_args_from_dict(config)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = build_model(args)
        reference = AutoModelForCausalLM.from_config(AutoConfig.for_model("log_linear_mamba2", **fields))
    assert sum(isinstance(m, FLALogLinearMamba2) for m in model.modules()) == 2
    assert not any(isinstance(m, FLALogLinearMamba2) for m in reference.modules())

    def layout(m):
        return {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()}

    assert layout(model) == layout(reference)
