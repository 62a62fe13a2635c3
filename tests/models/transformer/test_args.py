"""flame's transformer extensions: per-layer sliding windows (window_pattern) and their FLOPs."""

import pytest

from flame.errors import ModelConfigError
from tests.models.helpers import tiny_args, tiny_model


def test_window_pattern_sets_each_layers_window():
    model = tiny_model("transformer", num_heads=4, num_hidden_layers=5, window_pattern=[3, 3, None])
    windows = [block.attn.window_size for block in model.layers.values()]
    assert windows == [3, 3, None, 3, 3]


def test_window_pattern_flops_count_each_layers_context():
    args = tiny_args("transformer", num_heads=4, num_hidden_layers=2, window_pattern=[16, None])
    per_layer = 12 * args.hidden_size
    assert args.layer_flops_per_token(64) == per_layer * 16 + per_layer * 64


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"window_pattern": [4, None], "window_size": 4}, "window_pattern"),
        ({"window_pattern": [0]}, "window_pattern"),
        ({"window_pattern": []}, "window_pattern"),
        ({"layer_wise_scaling": {"qkv_multipliers": [1.0, 0.5], "ffn_multipliers": [1, 2], "head_dim": 8}},
         "layer_wise_scaling.qkv_multipliers"),
        ({"layer_wise_scaling": {"qkv_multipliers": [0.5, 1], "ffn_multipliers": [1, 2], "head_dim": 7}},
         "layer_wise_scaling.head_dim"),
        ({"layer_wise_scaling": {"qkv_multipliers": [0.5, 1], "ffn_multipliers": [1, 2], "head_dim": 8},
          "intermediate_size": 64}, "intermediate_size"),
        ({"num_heads": 5}, "num_heads"),  # 32 hidden, 5 heads
        ({"num_heads": 32}, "num_heads"),  # head_dim 1: RoPE needs pairs
        ({"attn_impl": "flash"}, "attn_impl"),
    ],
)  # fmt: skip
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ModelConfigError, match=field):
        tiny_args("transformer", **{"num_heads": 4, **overrides})
