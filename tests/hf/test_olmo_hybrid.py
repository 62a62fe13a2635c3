"""--format olmo_hybrid: where flame's hybrid Gated DeltaNet matches transformers' OLMo hybrid.

The linear-attention blocks match (tested here block against block); the attention blocks do not (OLMo's are
post-norm with full-width q/k norm), and transformers' class needs at least one, so every flame model is refused
with the reason."""

import pytest
import torch

from flame.models.gated_deltanet.state_dict_adapter import (
    olmo_linear_incompatibilities,
    olmo_linear_layer_to_hf,
)
from flame.utils import convert_dcp_to_hf
from tests.utils.helpers import save_checkpoint, tiny_model


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (
            {"attn": {"every": 2, "offset": 1, "num_heads": 4, "qk_norm": True}},
            "pre-norm with per-head q/k norm",
        ),
        ({}, "needs at least one attention layer"),
        ({"use_gate": False, "attn": {"layers": [1], "num_heads": 4}}, "use_gate false"),
    ],
)
def test_olmo_hybrid_export_is_refused_with_the_reason(tmp_path, capsys, overrides, reason):
    save_checkpoint(tmp_path / "dump", tiny_model("gated_deltanet", **overrides), step=1)
    out = tmp_path / "olmo"
    assert convert_dcp_to_hf.main(["--path", str(tmp_path / "dump"), "--output", str(out),
                                   "--format", "olmo_hybrid"]) == 2  # fmt: skip
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: cannot export this gated_deltanet model as olmo_hybrid") and reason in line
    assert not out.exists()


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_linear_attention_block_matches_olmo_hybrid(neg_eigval, monkeypatch):
    import inspect

    from transformers import OlmoHybridConfig
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridLinearAttentionDecoderLayer

    # With FLA installed transformers runs FLA's Triton kernel here, which needs a GPU: use its PyTorch reference.
    reference = inspect.unwrap(modeling_olmo_hybrid.torch_chunk_gated_delta_rule)
    monkeypatch.setattr(modeling_olmo_hybrid, "torch_chunk_gated_delta_rule", reference)

    model = tiny_model("gated_deltanet", norm_eps=1e-5, allow_neg_eigval=neg_eigval, intermediate_size=96)
    assert olmo_linear_incompatibilities(model.args) == []
    block = model.layers["0"]
    config = OlmoHybridConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=neg_eigval, rms_norm_eps=1e-5, hidden_act="silu",
    )  # fmt: skip
    olmo = OlmoHybridLinearAttentionDecoderLayer(config, layer_idx=0).eval()
    olmo.load_state_dict(olmo_linear_layer_to_hf(block.state_dict()), strict=True)
    x = torch.randn(2, 80, 64, generator=torch.Generator().manual_seed(0))  # beyond one 64-token chunk
    with torch.no_grad():
        expected = block(x, torch.arange(80).expand(2, -1))
        torch.testing.assert_close(olmo(x), expected, rtol=1e-4, atol=1e-5)
