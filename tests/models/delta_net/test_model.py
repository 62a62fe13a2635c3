"""The delta_net family: a tiny model's forward and backward in float32 and config values that must raise
ModelConfigError naming the field."""

import pytest
import torch

from flame.errors import ModelConfigError
from tests.models.helpers import tiny_args, tiny_model


@pytest.mark.parametrize("seq_len", [40, 70], ids=["fused_recurrent", "chunk"])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"use_gate": True, "qk_norm": "sum", "qk_activation": "relu"},
        {"attn": {"layers": [0], "num_heads": 2}},
    ],
    ids=["delta_net", "gated_sum_norm_relu", "hybrid"],
)
def test_forward_shape_and_backward(overrides, seq_len):
    model = tiny_model("delta_net", num_heads=4, **overrides)
    logits = model(torch.randint(0, 64, (2, seq_len)))
    assert logits.shape == (2, seq_len, 64) and logits.dtype == torch.float32
    logits.logsumexp(-1).mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_heads": 5}, "num_heads"),  # 32 hidden
        ({"expand_k": 0.3}, "expand_k"),  # 9.6 key dims
        ({"expand_v": 0.75, "num_heads": 16}, "num_heads"),  # 24 value dims over 16 heads
        ({"qk_activation": "gelu"}, "qk_activation"),
        ({"qk_norm": "l1"}, "qk_norm"),
        ({"attn": [{"layers": [0], "num_heads": 4}, {"layers": [0], "num_heads": 2}]}, r"attn\[1\]"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ModelConfigError, match=field):
        tiny_args("delta_net", **{"num_heads": 4, **overrides})
