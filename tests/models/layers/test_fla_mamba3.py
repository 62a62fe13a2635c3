"""flame.models.layers.fla_mamba3: FLA's Mamba3 layer with its SISO scan on flame.ops.mamba3, on the CPU in float64,
against the layer computed token by token as FLA's decoding path does: FLA's own per-token preprocessing
(``Mamba3._preprocess_step``: A, dt, the trapezoid's sigmoid, the normed B and C per head, the angles), then the
recurrence that mamba_ssm's step kernels compute (its test reference ``mamba3_siso_step_ref``: the biased queries
and keys rotated by the accumulated angles, the trapezoidal state update, the D skip and the z gate or the gated
output norm), then FLA's out-projection. Outputs, the input's and every parameter's gradient within 1e-12 relative
to the largest value (float64 both sides; a wrong split, bias, rotation, trapezoid term or gate differs at order
one). FLA's RMSNormGated is a Triton kernel: both sides get a PyTorch one, checked against FLA's PyTorch reference."""

import math

import pytest
import torch
from torch import nn

pytest.importorskip("fla")

from fla.modules.layernorm_gated import rms_norm_ref  # noqa: E402

from flame.models import build_model, model_args_from_dict  # noqa: E402
from flame.models.layers.fla_mamba3 import FLAMamba3  # noqa: E402
from tests.models.layers.packed_documents import assert_packed_equals_alone  # noqa: E402

LIMIT = 1e-12


class ReferenceRMSNorm(nn.Module):
    """FLA's RMSNormGated (same weight, eps, group size, gate order) in the input's dtype: FLA's PyTorch reference
    (``rms_norm_ref``) takes the weight in float32, which would round its gradient to float32."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, z=None):
        n = self.norm
        if z is not None and not n.norm_before_gate:
            x = x * nn.functional.silu(z)
        groups = x.unflatten(-1, (-1, n.group_size or x.shape[-1]))
        out = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + n.eps)).flatten(-2) * n.weight
        return out * nn.functional.silu(z) if z is not None and n.norm_before_gate else out


@pytest.mark.parametrize("gated", [False, True])
def test_the_norm_stand_in_is_flas_reference(gated):
    from fla.modules.layernorm_gated import RMSNormGated

    torch.manual_seed(0)
    for norm in (RMSNormGated(8), RMSNormGated(16, norm_before_gate=True, group_size=4)):
        with torch.no_grad():
            norm.weight.add_(torch.randn_like(norm.weight))
        x = torch.randn(3, 5, norm.weight.shape[0], dtype=torch.float64)
        z = torch.randn_like(x) if gated else None
        want = rms_norm_ref(x, norm.weight, None, z=z, eps=norm.eps, group_size=norm.group_size,
                            norm_before_gate=norm.norm_before_gate, upcast=False)  # fmt: skip
        torch.testing.assert_close(ReferenceRMSNorm(norm.double())(x, z), want, rtol=1e-7, atol=1e-7)


def layer(**options) -> FLAMamba3:
    torch.manual_seed(0)
    layer = FLAMamba3(hidden_size=24, state_size=8, head_dim=4, expand=2, chunk_size=16, **options).double()
    with (
        torch.no_grad()
    ):  # biases, D and the rank projections off their constant initial values: a mix-up shows
        for p in (layer.B_bias, layer.C_bias, layer.D) + (
            (layer.mimo_x, layer.mimo_z, layer.mimo_o) if layer.is_mimo else ()
        ):
            p.add_(torch.randn_like(p) * 0.5)
    layer.B_norm, layer.C_norm = ReferenceRMSNorm(layer.B_norm), ReferenceRMSNorm(layer.C_norm)
    # FLA's formula for A in the input's dtype: FLA's rounds it to float32, whose softplus rounds differently for a
    # whole sequence and for one token (1e-9 apart here), on both sides alike.
    layer._compute_a = lambda dd_A: (-nn.functional.softplus(dd_A)).clamp(max=-layer.A_floor)
    if layer.is_outproj_norm:
        layer.norm = ReferenceRMSNorm(layer.norm)
    return layer


def rotate(x: torch.Tensor, theta: torch.Tensor, pairwise: bool) -> torch.Tensor:
    """x's channel pairs as complex numbers times exp(i theta): (2i, 2i + 1) for SISO layers, (i, i + width / 2)
    for MIMO ones (mamba_ssm's kernels and FLA's MIMO step); channels past theta's pairs stay."""
    count, half = theta.shape[-1], x.shape[-1] // 2
    if pairwise:
        index = torch.arange(2 * count).view(-1, 2)
    else:
        index = torch.stack((torch.arange(count), torch.arange(count) + half), dim=-1)
    turned = torch.view_as_real(
        torch.complex(x[..., index[:, 0]], x[..., index[:, 1]]) * torch.exp(1j * theta)
    )
    out = x.clone()
    out[..., index[:, 0]], out[..., index[:, 1]] = turned[..., 0], turned[..., 1]
    return out


def token_by_token(layer: FLAMamba3, hidden: torch.Tensor) -> torch.Tensor:
    """mamba_ssm's step references (``mamba3_siso_step_ref``, ``mamba3_MIMO_step_ref``) after FLA's per-token
    preprocessing: the rank's values x * mimo_x, the state's rank-r update, each rank's output gated by z * mimo_z
    (or normed with it) and contracted with mimo_o; a SISO layer is rank 1 with no projections."""
    batch, length, _ = hidden.shape
    heads, state_size, rank = layer.num_heads, layer.ssm_state_size, layer.mimo_rank
    ones = hidden.new_ones(heads, 1, layer.head_dim)
    mimo_x, mimo_z, mimo_o = (
        (layer.mimo_x, layer.mimo_z, layer.mimo_o) if layer.is_mimo else (ones, ones, ones)
    )
    angle_state = hidden.new_zeros(batch, heads, layer.num_rope_angles)
    state = hidden.new_zeros(batch, heads, layer.head_dim, state_size)
    k_state = hidden.new_zeros(batch, rank, heads, state_size)
    v_state = hidden.new_zeros(batch, rank, heads, layer.head_dim)
    outputs = []
    for t in range(length):
        z, x, B, C, dd_dt, dd_A, trap, angles = layer._project_and_split(hidden[:, t])
        dt, B, C, x, z, trap, A, angles = layer._preprocess_step(dd_A, dd_dt, B, C, x, z, trap, angles)
        angle_state = angle_state + torch.tanh(angles) * math.pi * dt[..., None]
        angle_state = angle_state - 2 * math.pi * torch.floor(angle_state / (2 * math.pi))
        q = rotate(C + layer.C_bias.transpose(0, 1), angle_state[:, None], pairwise=not layer.is_mimo)
        k = rotate(B + layer.B_bias.transpose(0, 1), angle_state[:, None], pairwise=not layer.is_mimo)
        v = x[:, None] * mimo_x.transpose(0, 1)  # [batch, rank, heads, head_dim]
        alpha = torch.exp(A * dt)
        state = (
            alpha[..., None, None] * state
            + ((1 - trap) * dt * alpha)[..., None, None] * torch.einsum("brhp,brhn->bhpn", v_state, k_state)
            + (trap * dt)[..., None, None] * torch.einsum("brhp,brhn->bhpn", v, k)
        )
        y = torch.einsum("bhpn,brhn->brhp", state, q) + layer.D[:, None] * v
        k_state, v_state = k, v
        gates = z[:, None] * mimo_z.transpose(0, 1)
        if layer.is_outproj_norm:
            y = layer.norm(y.flatten(-2), gates.flatten(-2)).unflatten(-1, (heads, layer.head_dim))
        else:
            y = y * gates * torch.sigmoid(gates)
        outputs.append(layer.out_proj(torch.einsum("brhp,hrp->bhp", y, mimo_o).flatten(-2)))
    return torch.stack(outputs, dim=1)


MIMO = {"is_mimo": True, "mimo_rank": 3}
CASES = {
    "siso": {},
    "two_groups_full_rotation": {"n_groups": 2, "rope_fraction": 1.0},
    "output_norm": {"is_outproj_norm": True},
    "mimo": MIMO,
    "mimo_two_groups_full_rotation": {**MIMO, "n_groups": 2, "rope_fraction": 1.0},
    "mimo_output_norm": {**MIMO, "is_outproj_norm": True},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_forward_and_gradients_equal_the_token_by_token_layer(options):
    """37 tokens (past two of FLA's 16-token chunks and not a multiple of flame's 64): the whole-sequence forward
    against the token-by-token one, output and gradients."""
    ours = layer(**options)
    hidden = torch.randn(2, 37, 24, dtype=torch.float64)
    grad = torch.randn(2, 37, 24, dtype=torch.float64)
    results = []
    for forward in (lambda h: ours(h)[0], lambda h: token_by_token(ours, h)):
        ours.zero_grad()
        leaf = hidden.clone().requires_grad_()
        out = forward(leaf)
        out.backward(grad)
        results.append((out, leaf.grad, {n: p.grad.clone() for n, p in ours.named_parameters()}))
    (out, dx, grads), (want, want_dx, want_grads) = results
    for name, got, reference in [("output", out, want), ("input", dx, want_dx)] + [
        (n, grads[n], want_grads[n]) for n in want_grads
    ]:
        difference = (got - reference).abs().max() / reference.abs().max()
        assert difference <= LIMIT, f"{name}: {difference:.1e} of the largest value"


@pytest.mark.parametrize("options", [{}, MIMO], ids=["siso", "mimo"])
def test_packed_documents_equal_each_document_alone(options):
    """cu_seqlens: one row of three documents (one of a single token, one past a 16-token chunk) gives each
    document's output and the gradients of the documents run one by one, float64, 1e-10 of the largest value."""
    assert_packed_equals_alone(layer(**options), 24, limit=1e-10)


def test_padding_stays_flas_path():
    """What flame's scan does not compute goes to FLA's own path, which on the CPU refuses in its own words."""
    hidden = torch.randn(1, 5, 24, dtype=torch.float64)
    mask = torch.ones(1, 5, dtype=torch.long)
    layer()(hidden, attention_mask=mask)  # no padding: flame's scan
    mask[0, 0] = 0
    with pytest.raises(NotImplementedError, match="Mamba-3 currently requires a CUDA device"):
        layer()(hidden, attention_mask=mask)


@pytest.mark.parametrize(
    "options", [{}, {"is_outproj_norm": True}, MIMO, {**MIMO, "is_outproj_norm": True}],
    ids=["siso", "output_norm", "mimo", "mimo_output_norm"],
)  # fmt: skip
def test_prefill_then_decoding_equals_the_whole_sequence(options):
    """A prompt's prefill of 30 tokens keeps the states mamba_ssm returns in FLA's cache, and the next 7 tokens
    decoded one at a time from it give the whole sequence's last 7 outputs (float64, 1e-12 of the largest value)."""
    from fla.models.cache_utils import Cache

    ours = layer(layer_idx=0, **options)
    hidden = torch.randn(2, 37, 24, dtype=torch.float64)
    with torch.no_grad():
        whole = ours(hidden)[0]
        cache = Cache()
        outputs = [ours(hidden[:, :30], past_key_values=cache, use_cache=True)[0]]
        for t in range(30, 37):
            outputs.append(ours(hidden[:, t : t + 1], past_key_values=cache, use_cache=True)[0])
    decoded = torch.cat(outputs, dim=1)
    assert (decoded - whole).abs().max() <= 1e-12 * whole.abs().max()
    assert cache.get_seq_length(0) == 37


def test_generic_mamba3_builds_flames_layer_with_flas_state_dict():
    """mamba3 through the generic family (no mamba_ssm here) builds FLAMamba3 layers with FLA's state-dict layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"model_type": "mamba3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16,
              "state_size": 16}  # fmt: skip
    args, _ = model_args_from_dict(config)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = build_model(args)
        reference = AutoModelForCausalLM.from_config(AutoConfig.for_model("mamba3", **fields))
    assert sum(isinstance(m, FLAMamba3) for m in model.modules()) == 2
    assert not any(isinstance(m, FLAMamba3) for m in reference.modules())

    def layout(m):
        return {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()}

    assert layout(model) == layout(reference)


def test_the_build_names_the_layers_flame_runs_in_place_of_flas(caplog):
    """FLA's Mamba3 constructor warns that mamba_ssm's kernels (and MIMO) are unavailable; the generic build says in
    one line that its layers are flame's, which need neither."""
    config = {"model_type": "mamba3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16,
              "state_size": 16, "is_mimo": True, "mimo_rank": 2}  # fmt: skip
    with caplog.at_level("INFO", logger="flame.models.generic.model"), torch.device("meta"):
        build_model(model_args_from_dict(config)[0])
    lines = [r.getMessage() for r in caplog.records if r.name == "flame.models.generic.model"]
    assert len(lines) == 1 and "Mamba3 as FLAMamba3" in lines[0], lines
