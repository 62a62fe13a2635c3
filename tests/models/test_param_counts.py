"""Parameter counts of flame's models equal those of FLA 0.6.0's own HF classes built from the same config JSON,
and so do parameter names and shapes under the prefix rule of flame/models/common/decoder.py (FLA's names are
flame's with ``model.`` in front, except ``lm_head``).

Both sides are built on the meta device. Where a config uses flame extensions, FLA's side is built as follows:
- ``attn``: FLA gets flame's normalised spec (explicit ``layers``; FLA's config class does not know flame's
  ``every``/``offset``). Its hybrid attention has no ``qk_norm`` option although its Attention module has one, so
  the test passes a spec's ``qk_norm`` on to FLA's Attention (``get_attention_passing_qk_norm``).
- scaled attention (``attn_impl`` parallel_scaled_*) adds one learnable query scale per head and layer, which FLA's
  transformer lacks: the expected count adds num_heads x num_hidden_layers.
- ``window_pattern`` changes no parameter; ``layer_wise_scaling`` has no FLA counterpart (its shapes are checked
  in tests/models/layers/test_lws.py), so those configs are skipped.
- hybrids with OLMo's attention blocks (``"qk_norm_scope": "full"``: q/k norm weights over all heads) have no FLA
  counterpart either; they are compared with transformers' ``OlmoHybridForCausalLM`` built from the config flame's
  ``--format olmo_hybrid`` export writes, names mapped by that export.
FLA's Attention refuses to be constructed without the flash_attn package, which only its forward needs: the test
sets the module's ``flash_attn_func`` to a placeholder.
"""

import json
from pathlib import Path

import pytest
import torch
from fla.layers import attn as fla_attn
from fla.models import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    GatedDeltaNetConfig,
    GatedDeltaNetForCausalLM,
    TransformerConfig,
    TransformerForCausalLM,
)
from fla.models.configuration_utils import get_attention_spec
from fla.models.delta_net import modeling_delta_net
from fla.models.gated_deltanet import modeling_gated_deltanet

from flame.models import build_model, load_model_args
from flame.models.common.choices import ATTN_IMPLS
from flame.models.gated_deltanet.state_dict_adapter import OlmoHybridAdapter

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.json"))
FLA_CLASSES = {
    "transformer": (TransformerConfig, TransformerForCausalLM),
    "gated_deltanet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM),
    "delta_net": (DeltaNetConfig, DeltaNetForCausalLM),
}


def get_attention_passing_qk_norm(config, layer_idx):
    """FLA's ``fla.models.modeling_utils.get_attention``, also passing the spec's qk_norm to FLA's Attention."""
    spec = get_attention_spec(config.attn, layer_idx=layer_idx)
    if spec is None:
        return None
    return fla_attn.Attention(
        hidden_size=config.hidden_size,
        num_heads=spec["num_heads"],
        num_kv_heads=spec["num_kv_heads"],
        qkv_bias=spec["qkv_bias"],
        qk_norm=spec.get("qk_norm", False),
        window_size=spec["window_size"],
        rope_theta=spec["rope_theta"],
        max_position_embeddings=config.max_position_embeddings,
        layer_idx=layer_idx,
    )


@pytest.fixture(scope="module")
def fla_patched():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fla_attn, "flash_attn_func", object())
        for module in (modeling_gated_deltanet, modeling_delta_net):
            patch.setattr(module, "get_attention", get_attention_passing_qk_norm)
        yield


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def shapes(model: torch.nn.Module, strip: str = "") -> dict[str, tuple[int, ...]]:
    return {name.removeprefix(strip): tuple(p.shape) for name, p in model.named_parameters()}


def olmo_attention(config: dict) -> bool:
    specs = config.get("attn") or []
    return any(
        spec.get("qk_norm_scope") == "full" for spec in ([specs] if isinstance(specs, dict) else specs)
    )


# Layer-wise scaling (OpenELM) has no FLA counterpart; tests/models/layers/test_lws.py checks its sizes.
FLA_COMPARABLE = [
    p
    for p in CONFIGS
    if "layer_wise_scaling" not in (c := json.loads(p.read_text())) and not olmo_attention(c)
]
OLMO_COMPARABLE = [p for p in CONFIGS if olmo_attention(json.loads(p.read_text()))]


@pytest.mark.parametrize("path", FLA_COMPARABLE, ids=[p.stem for p in FLA_COMPARABLE])
def test_flame_counts_what_fla_counts(path, fla_patched):
    args, _ = load_model_args(path)
    config = json.loads(path.read_text())
    config_cls, model_cls = FLA_CLASSES[config.pop("model_type")]
    if "attn" in config:
        config["attn"] = args.attn
    with torch.device("meta"):
        flame_model = build_model(args)
        fla_model = model_cls(config_cls(**config))
    expected = count(fla_model)
    flame_shapes = shapes(flame_model)
    if ATTN_IMPLS[getattr(args, "attn_impl", "parallel_attn")][1]:  # scaled: one query scale per head
        expected += args.num_heads * args.num_hidden_layers
        flame_shapes = {name: shape for name, shape in flame_shapes.items() if not name.endswith(".q_scale")}
    assert count(flame_model) == expected
    assert flame_shapes == shapes(fla_model, strip="model.")


@pytest.mark.parametrize("path", OLMO_COMPARABLE, ids=[p.stem for p in OLMO_COMPARABLE])
def test_flame_counts_what_transformers_olmo_hybrid_counts(path):
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    args, _ = load_model_args(path)
    adapter = OlmoHybridAdapter(args)
    config = {k: v for k, v in adapter.hf_config().items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        flame_model = build_model(args)
        olmo = OlmoHybridForCausalLM(OlmoHybridConfig(**config))
        hf = adapter.to_hf(dict(flame_model.named_parameters()))
        for i in range(args.num_hidden_layers):  # transformers >= 5.17 holds the q/k/v convolutions as one
            convs = [hf.pop(f"model.layers.{i}.linear_attn.{x}_conv1d.weight", None) for x in "qkv"]
            if convs[0] is not None:
                hf[f"model.layers.{i}.linear_attn.conv1d.weight"] = torch.cat(convs)
    assert count(flame_model) == count(olmo)
    assert {name: tuple(p.shape) for name, p in hf.items()} == shapes(olmo)
