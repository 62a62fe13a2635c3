"""OpenELM layer-wise scaling: make_divisible, and the OpenELM-270M shapes (16 layers, d 1280, head_dim 64,
4 query heads per KV head: query heads 12 x5, 16 x7, 20 x4; FFN width 768 -> 5120) in the transformer built from
configs/openelm_270m_lws_gqa.json."""

from pathlib import Path

import torch

from flame.models import build_model, load_model_args
from flame.models.layers.lws import LayerWiseScaling, layer_multipliers, make_divisible

CONFIG = Path(__file__).parents[3] / "configs" / "openelm_270m_lws_gqa.json"
OPENELM_270M_QUERY_HEADS = [12] * 5 + [16] * 7 + [20] * 4


def test_make_divisible_rounds_to_nearest_multiple_but_never_10_percent_down():
    assert make_divisible(640, 256) == 768  # nearest multiple
    assert make_divisible(896, 256) == 1024
    assert make_divisible(857.6, 256) == 1024  # nearest is 768, more than 10% below
    assert make_divisible(806.4, 256) == 768  # 768 is within 10%
    assert make_divisible(10, 256) == 256  # never below the divisor


def test_multipliers_are_rounded_linspace():
    assert layer_multipliers((0.5, 1.0), 16)[:6] == [0.5, 0.53, 0.57, 0.6, 0.63, 0.67]
    assert layer_multipliers((0.5, 4.0), 16)[-1] == 4.0


def test_openelm_270m_layer_dims():
    lws = LayerWiseScaling.from_dict(
        {"qkv_multipliers": [0.5, 1.0], "ffn_multipliers": [0.5, 4.0], "head_dim": 64, "gqa_groups": 4}
    )
    dims = [lws.layer_dims(i, 16, 1280) for i in range(16)]
    assert [d.num_heads for d in dims] == OPENELM_270M_QUERY_HEADS
    assert [d.num_kv_heads for d in dims] == [h // 4 for h in OPENELM_270M_QUERY_HEADS]
    assert dims[0].intermediate_size == 768 and dims[-1].intermediate_size == 5120
    assert all(a.intermediate_size <= b.intermediate_size for a, b in zip(dims, dims[1:]))


def test_openelm_config_builds_scaled_layers():
    args, _ = load_model_args(CONFIG)
    with torch.device("meta"):
        model = build_model(args)
    for i, heads in enumerate(OPENELM_270M_QUERY_HEADS):
        attention, mlp = model.layers[str(i)].attn, model.layers[str(i)].mlp
        assert attention.q_proj.out_features == heads * 64
        assert attention.k_proj.out_features == attention.v_proj.out_features == heads // 4 * 64
        assert attention.o_proj.in_features == heads * 64
        assert mlp.gate_proj.out_features == args.layer_dims(i).intermediate_size
    assert model.layers["0"].mlp.up_proj.out_features == 768
    assert model.layers["15"].mlp.down_proj.in_features == 5120
