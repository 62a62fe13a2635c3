"""no_weight_decay_names: every parameter below two dimensions, plus the embeddings on request."""

from flame.models.common.weight_decay import no_weight_decay_names
from tests.models.helpers import tiny_model

GDN_HYBRID = {
    "head_dim": 8,
    "num_heads": 2,
    "attn": {"layers": [1], "num_heads": 4, "qkv_bias": True, "qk_norm": True},
}


def test_norms_biases_and_decay_parameters_are_excluded():
    model = tiny_model("gated_deltanet", **GDN_HYBRID)
    expected = {
        "layers.0.attn_norm.weight", "layers.0.mlp_norm.weight", "layers.1.attn_norm.weight",
        "layers.1.mlp_norm.weight", "norm.weight",
        "layers.0.attn.A_log", "layers.0.attn.dt_bias", "layers.0.attn.o_norm.weight",
        "layers.1.attn.q_proj.bias", "layers.1.attn.k_proj.bias", "layers.1.attn.v_proj.bias",
        "layers.1.attn.q_norm.weight", "layers.1.attn.k_norm.weight",
    }  # fmt: skip
    assert no_weight_decay_names(model) == expected
    assert no_weight_decay_names(model, exclude_embeddings=True) == expected | {"embeddings.weight"}


def test_tied_embeddings_are_one_parameter_and_scaled_attention_scales_are_excluded():
    model = tiny_model("transformer", num_heads=4, tie_word_embeddings=True, attn_impl="parallel_scaled_attn")
    names = no_weight_decay_names(model, exclude_embeddings=True)
    assert "embeddings.weight" in names and not any(name.startswith("lm_head") for name in names)
    assert {"layers.0.attn.q_scale", "layers.1.attn.q_scale"} <= names
