"""Hybrids: the ``attn`` field (FLA's spelling and flame's every/offset pattern), the attention layers it builds,
its validation, and packed documents through whole hybrid models (float64, 1e-10)."""

import pytest
import torch

from flame.errors import ModelConfigError
from flame.models.layers.attention import Attention
from flame.models.layers.delta_net import DeltaNet
from flame.models.layers.gated_deltanet import GatedDeltaNet
from tests.models.helpers import packed_and_alone, tiny_args, tiny_model

GDN = {"head_dim": 8, "num_heads": 2}
# One layer of each mixer kind: the family's own, softmax attention with QK-norm, GQA and a sliding window,
# scaled softpick attention (its queries depend on the position inside the document), and OLMo's attention block
# (norms on the branch outputs, q/k norm over all heads).
MIXED_ATTN = [
    {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qk_norm": True, "window_size": 6},
    {"layers": [2], "num_heads": 2, "attn_impl": "parallel_scaled_softpick_attn"},
    {"layers": [3], "num_heads": 4, "num_kv_heads": 2, "qk_norm": True, "qk_norm_scope": "full",
     "norm_order": "post"},
]  # fmt: skip


def test_every_and_offset_select_a_repeating_pattern():
    args = tiny_args(
        "gated_deltanet", **GDN, num_hidden_layers=8, attn={"every": 4, "offset": 3, "num_heads": 4}
    )
    assert args.attn["layers"] == [3, 7]
    model = tiny_model(
        "gated_deltanet", **GDN, num_hidden_layers=8, attn={"every": 4, "offset": 3, "num_heads": 4}
    )
    kinds = [type(block.attn) for block in model.layers.values()]
    assert kinds == [GatedDeltaNet] * 3 + [Attention] + [GatedDeltaNet] * 3 + [Attention]


def test_attn_is_normalised_to_fla_spelling_and_round_trips():
    args = tiny_args(
        "delta_net", num_heads=4, num_hidden_layers=4, attn={"every": 2, "num_heads": 4, "qk_norm": True}
    )
    assert args.attn == {
        "layers": [0, 2],
        "num_heads": 4,
        "num_kv_heads": 4,
        "qkv_bias": False,
        "window_size": None,
        "rope_theta": 10000.0,
        "qk_norm": True,
        "attn_impl": "parallel_attn",
        "qk_norm_scope": "head",
        "norm_order": "pre",
    }
    again, unknown = type(args).from_dict(args.to_dict())
    assert again == args and unknown == []


def test_attention_layers_get_their_spec():
    model = tiny_model("delta_net", num_heads=4, num_hidden_layers=4, attn=MIXED_ATTN)
    first, second, third, fourth = (block.attn for block in model.layers.values())
    assert isinstance(first, DeltaNet)
    assert (second.num_heads, second.num_kv_heads, second.window_size) == (4, 2, 6)
    assert second.q_norm.weight.shape == second.k_norm.weight.shape == (8,) and second.head_dim == 8
    assert third.scaled and third.score_fn == "softpick" and third.q_norm is None
    assert fourth.q_norm.weight.shape == (32,) and fourth.k_norm.weight.shape == (16,)  # 4 and 2 heads of 8
    assert [block.norm_order for block in model.layers.values()] == ["pre", "pre", "pre", "post"]


def test_post_norm_order_normalises_the_branch_outputs():
    model = tiny_model("gated_deltanet", **GDN, attn={"layers": [1], "num_heads": 4, "norm_order": "post"})
    block = model.layers["1"]
    torch.nn.init.normal_(block.attn_norm.weight)
    torch.nn.init.normal_(block.mlp_norm.weight)
    x, positions = torch.randn(2, 5, 32), torch.arange(5).expand(2, -1)
    with torch.no_grad():
        h = x + block.attn_norm(block.attn(x, positions))
        torch.testing.assert_close(block(x, positions), h + block.mlp_norm(block.mlp(h)), rtol=0, atol=0)


def test_full_width_qk_norm_normalises_all_heads_at_once():
    model = tiny_model(
        "gated_deltanet",
        **GDN,
        attn={"layers": [1], "num_heads": 4, "qk_norm": True, "qk_norm_scope": "full"},
    )
    attention = model.layers["1"].attn
    x = torch.randn(1, 3, 32)
    seen = []
    attention.q_norm.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    attention(x, torch.arange(3)[None])
    assert seen == [(1, 3, 32)]  # the whole projection, not [1, 3, 4, 8] per head


def test_flops_count_attention_layers():
    args = tiny_args("gated_deltanet", **GDN, num_hidden_layers=4, attn=MIXED_ATTN)
    # Three attention layers (window 6, full 64 twice) and one Gated DeltaNet layer.
    assert (
        args.layer_flops_per_token(64) == 12 * args.hidden_size * (6 + 64 + 64) + args.mixer_flops_per_token()
    )
    assert args.mixer_flops_per_token() > 0


@pytest.mark.parametrize(
    ("attn", "field"),
    [
        ({"layers": [2], "num_heads": 4}, "attn.layers"),  # out of range: 2 layers
        ({"layers": [0, 0], "num_heads": 4}, "attn.layers"),
        ({"layers": [0], "num_heads": 5}, "attn.num_heads"),  # 32 hidden
        ({"layers": [0], "num_heads": 32}, "attn.num_heads"),  # head_dim 1: RoPE needs pairs
        ({"layers": [0], "num_heads": 4, "num_kv_heads": 3}, "attn.num_kv_heads"),
        ({"layers": [0], "num_heads": 4, "attn_impl": "softmax"}, "attn.attn_impl"),
        ({"layers": [0], "num_heads": 4, "window_size": 0}, "attn.window_size"),
        ({"layers": [0], "num_heads": 4, "qk_norm": "yes"}, "attn.qk_norm"),
        ({"layers": [0], "num_heads": 4, "qk_norm": True, "qk_norm_scope": "all"}, "attn.qk_norm_scope"),
        ({"layers": [0], "num_heads": 4, "qk_norm_scope": "full"}, "attn.qk_norm_scope 'full' needs"),
        ({"layers": [0], "num_heads": 4, "norm_order": "sandwich"}, "attn.norm_order"),
        ({"layers": [0], "num_heads": 4, "qknorm": True}, "attn.qknorm"),
        ({"layers": [0]}, "attn.num_heads"),
        ({"num_heads": 4}, "attn"),
        ({"layers": [0], "every": 2, "num_heads": 4}, "attn"),
        ({"every": 4, "offset": 4, "num_heads": 4}, "attn.offset"),
        ({"every": 4, "offset": 3, "num_heads": 4}, "attn.offset"),  # selects nothing of 2 layers
        ([{"layers": [0], "num_heads": 4}, {"layers": [1, 0], "num_heads": 2}], r"attn\[1\].layers"),
        ("layers 0", "attn"),
    ],
)
def test_bad_attn_values_name_the_field(attn, field):
    with pytest.raises(ModelConfigError, match=field):
        tiny_args("gated_deltanet", **GDN, attn=attn)


@pytest.mark.parametrize(
    ("model_type", "overrides"), [("gated_deltanet", GDN), ("delta_net", {"num_heads": 4})]
)
def test_packed_documents_through_a_hybrid_model_match_documents_alone(model_type, overrides):
    model = tiny_model(model_type, torch.float64, **overrides, num_hidden_layers=4, attn=MIXED_ATTN)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, 64, (1, n), generator=generator) for n in (9, 1, 40, 17)]
    packed, alone = packed_and_alone(model, documents)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)


def test_tensor_parallelism_refuses_a_q_k_norm_over_all_heads():
    from flame.errors import ConfigError
    from flame.parallelize.checks import check_tensor_parallel

    attn = {"layers": [1], "num_heads": 4, "qk_norm": True}
    check_tensor_parallel(tiny_model("gated_deltanet", **GDN, attn=attn), tp=2, seq_len=64)
    full = tiny_model("gated_deltanet", **GDN, attn={**attn, "qk_norm_scope": "full"})
    with pytest.raises(ConfigError, match="does not support qk_norm_scope full"):
        check_tensor_parallel(full, tp=2, seq_len=64)
