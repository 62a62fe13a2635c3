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
# One layer of each mixer kind: the family's own, softmax attention with QK-norm, GQA and a sliding window, and
# scaled softpick attention (its queries depend on the position inside the document).
MIXED_ATTN = [
    {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qk_norm": True, "window_size": 6},
    {"layers": [2], "num_heads": 2, "attn_impl": "parallel_scaled_softpick_attn"},
]


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
    }
    again, unknown = type(args).from_dict(args.to_dict())
    assert again == args and unknown == []


def test_attention_layers_get_their_spec():
    model = tiny_model("delta_net", num_heads=4, num_hidden_layers=3, attn=MIXED_ATTN)
    first, second, third = (block.attn for block in model.layers.values())
    assert isinstance(first, DeltaNet)
    assert (second.num_heads, second.num_kv_heads, second.window_size) == (4, 2, 6)
    assert second.q_norm is not None and second.head_dim == 8
    assert third.scaled and third.score_fn == "softpick" and third.q_norm is None


def test_flops_count_attention_layers():
    args = tiny_args("gated_deltanet", **GDN, num_hidden_layers=3, attn=MIXED_ATTN)
    # Two attention layers (window 6, full 64) and one Gated DeltaNet layer.
    assert args.layer_flops_per_token(64) == 12 * args.hidden_size * (6 + 64) + args.mixer_flops_per_token()
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
    model = tiny_model(model_type, torch.float64, **overrides, num_hidden_layers=3, attn=MIXED_ATTN)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, 64, (1, n), generator=generator) for n in (9, 1, 40, 17)]
    packed, alone = packed_and_alone(model, documents)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
