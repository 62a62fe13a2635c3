"""The gated_deltanet family: a tiny model's forward and backward in float32, FLA's initialisation, and config
values that must raise ModelConfigError naming the field."""

import pytest
import torch

from flame.errors import ModelConfigError
from tests.models.helpers import tiny_args, tiny_model

GDN = {"head_dim": 8, "num_heads": 2}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_v_heads": 4, "use_gate": False, "allow_neg_eigval": True},
        {"attn": {"layers": [1], "num_heads": 4}},
    ],
    ids=["gated_deltanet", "grouped_ungated_neg_eigval", "hybrid"],
)
def test_forward_shape_and_backward(overrides):
    model = tiny_model("gated_deltanet", **GDN, **overrides)
    logits = model(torch.randint(0, 64, (2, 70)))
    assert logits.shape == (2, 70, 64) and logits.dtype == torch.float32
    logits.logsumexp(-1).mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_init_weights_is_flas():
    # Wide enough (1024 conv taps, 16k weights elsewhere) for 3-sigma bounds on the sample statistics.
    model = tiny_model("gated_deltanet", hidden_size=256, head_dim=64, num_heads=4, initializer_range=0.02)
    mixer = model.layers["0"].attn
    for weight in (mixer.q_proj.weight, mixer.q_conv1d.weight, mixer.o_proj.weight, model.embeddings.weight):
        assert abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002
    assert torch.equal(mixer.o_norm.weight, torch.ones_like(mixer.o_norm.weight))
    A = mixer.A_log.exp()
    assert (A > 0).all() and (A <= 16).all()
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert (dt >= 1e-3 * (1 - 1e-5)).all() and (dt <= 0.1 * (1 + 1e-5)).all()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_v_heads": 3}, "num_v_heads"),
        ({"num_v_heads": 1, "num_heads": 2}, "num_v_heads"),  # FLA lets this through to its kernels
        ({"expand_v": 0.3}, "expand_v"),  # head_dim 8 * 0.3 is not an integer
        ({"head_dim": 0}, "head_dim"),
        ({"conv_size": 0}, "conv_size"),
        ({"output_gate_activation": "relu"}, "output_gate_activation"),
        ({"output_norm_eps": 0}, "output_norm_eps"),
        ({"output_norm_eps": "1e-5"}, "output_norm_eps"),
        ({"attn": {"layers": [2], "num_heads": 4}}, "attn.layers"),
        ({"attn": {"layers": [0], "num_heads": 4, "attn_impl": "nope"}}, "attn.attn_impl"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ModelConfigError, match=field):
        tiny_args("gated_deltanet", **{**GDN, **overrides})


def test_output_norm_eps_sets_the_output_norm_alone():
    model = tiny_model("gated_deltanet", **GDN, norm_eps=1e-6, output_norm_eps=1e-5)
    block = model.layers["0"]
    assert (
        block.attn.o_norm.eps == 1e-5 and block.attn_norm.eps == block.mlp_norm.eps == model.norm.eps == 1e-6
    )
    assert tiny_model("gated_deltanet", **GDN, norm_eps=1e-6).layers["0"].attn.o_norm.eps == 1e-6


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_block_equals_the_eager_one(backend):
    """torch.compile's backends on the CPU, float64: output and every gradient within 1e-12 of the eager block.
    aot_eager runs AOTAutograd's traced backward by PyTorch itself, which the gate's softplus once broke
    (flame.compat.contiguous_gradient)."""
    block = tiny_model(
        "gated_deltanet", dtype=torch.float64, head_dim=8, num_heads=2, num_hidden_layers=1
    ).layers["0"]
    x = torch.randn(2, 80, 32, dtype=torch.float64, requires_grad=True)
    position_ids = torch.arange(80).expand(2, -1)
    results = []
    for run in (block, torch.compile(block, backend=backend)):
        x.grad = None
        block.zero_grad()
        out = run(x, position_ids, None)
        out.square().sum().backward()
        results.append([out, x.grad, *(p.grad for p in block.parameters())])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-12)
