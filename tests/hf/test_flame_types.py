"""Exports in FLA's format and in flame's own model types (flame/hf): which one a model gets, that transformers
loads it, and that the loaded model's logits equal those of flame's training model on the same input."""

import json
import subprocess
import sys

import pytest
import torch

from flame.cli import convert_dcp_to_hf
from flame.hf.load import load_flame_model
from tests.utils.helpers import REPO, save_checkpoint, tiny_model, tokens

# Models FLA's classes would compute differently: exported as flame_<family>.
FLAME_ONLY = {
    "scaled-softpick-tied": ("transformer", {"attn_impl": "parallel_scaled_softpick_attn", "tie_word_embeddings": True}),
    "layer-wise-scaling": ("transformer", {"num_kv_heads": None, "layer_wise_scaling": {
        "qkv_multipliers": [0.5, 1.0], "ffn_multipliers": [0.5, 2.0], "head_dim": 16, "gqa_groups": 2}}),
    "window-pattern": ("transformer", {"window_pattern": [8, None]}),
    "gdn-hybrid-qk-norm": ("gated_deltanet", {"attn": {"every": 2, "offset": 1, "num_heads": 4, "qk_norm": True}}),
    "delta-net-hybrid-rectified": ("delta_net", {"attn": {"layers": [0], "num_heads": 4,
                                                          "attn_impl": "parallel_rectified_attn"}}),
}  # fmt: skip
# Models FLA's classes compute exactly: --format fla fits them (auto prefers transformers' own classes).
FLA_TYPES = {
    "transformer": ("transformer", {}),
    "transformer-qk-norm": ("transformer", {"qk_norm": True, "norm_eps": 1e-5, "window_size": 8}),
    "gdn": ("gated_deltanet", {"allow_neg_eigval": True}),
    "gdn-hybrid": ("gated_deltanet", {"attn": {"layers": [1], "num_heads": 4, "window_size": 8}, "tie_word_embeddings": True}),
    "delta-net": ("delta_net", {}),
}  # fmt: skip


def export(tmp_path, model_type: str, overrides: dict, *flags: str):
    model = tiny_model(model_type, **overrides)
    save_checkpoint(tmp_path / "dump", model, step=5)
    out = tmp_path / "hf"
    assert convert_dcp_to_hf.main(["--path", str(tmp_path / "dump"), "--output", str(out), *flags]) == 0
    return model, out, json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("case", list(FLAME_ONLY))
def test_flame_types_load_after_import_flame_with_the_training_logits(tmp_path, case):
    from transformers import AutoModelForCausalLM

    model_type, overrides = FLAME_ONLY[case]
    model, out, config = export(tmp_path, model_type, overrides)
    assert config["model_type"] == f"flame_{model_type}"
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__.startswith("Flame") and hf.config.model_type == config["model_type"]
    x = tokens()
    with torch.no_grad():
        assert torch.equal(hf(x).logits, model(x))
    greedy = hf.generate(x[:1, :4], max_new_tokens=3, do_sample=False)
    assert greedy.shape == (1, 7) and torch.equal(greedy[0, 4], model(x[:1, :4])[0, -1].argmax())


@pytest.mark.parametrize("case", list(FLA_TYPES))
def test_fla_types_fit_fla_classes(tmp_path, case):
    """FLA's config class reads config.json as written, its model has exactly the exported weights (names and
    shapes, built on the meta device: FLA's forward needs Triton, see tests/gpu/test_hf_export.py), and flame
    reads the folder back into its own model with the training logits."""
    import fla.models  # noqa: F401  (registers FLA's model types)
    from fla.layers import attn as fla_attn
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = FLA_TYPES[case]
    model, out, config = export(tmp_path, model_type, overrides, "--format", "fla")
    assert config["model_type"] == model_type
    fla_config = AutoConfig.from_pretrained(out)
    assert type(fla_config).__module__.startswith("fla.")
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_heads",
        "vocab_size",
        "attn",
        "window_size",
        "qk_norm",
    ):
        assert getattr(fla_config, key, None) == config.get(key), key
    with pytest.MonkeyPatch.context() as patch, torch.device("meta"):
        patch.setattr(fla_attn, "flash_attn_func", object())  # only FLA's forward needs flash_attn
        fla_model = AutoModelForCausalLM.from_config(fla_config)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert saved == {k: tuple(p.shape) for k, p in fla_model.named_parameters()}
    x = tokens()
    with torch.no_grad():
        assert torch.equal(load_flame_model(out)(x), model(x))


def test_transformers_refuses_flame_types_without_flame(tmp_path):
    """A softpick export is flame_transformer: without `import flame` transformers does not know it, so it never
    loads as FLA's softmax transformer. A Llama export needs no import at all."""
    _, softpick, _ = export(tmp_path / "a", "transformer", {"attn_impl": "parallel_softpick_attn"})
    model, llama, _ = export(tmp_path / "b", "transformer", {}, "--format", "llama")
    torch.save(tokens(), tmp_path / "x.pt")
    torch.save(model(tokens()).detach(), tmp_path / "y.pt")
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(softpick)!r})
    print("loaded")
except Exception as e:
    print("refused:", type(e).__name__, "flame_transformer" in str(e))
m = AutoModelForCausalLM.from_pretrained({str(llama)!r}).eval()
torch.testing.assert_close(m(torch.load({str(tmp_path / "x.pt")!r})).logits, torch.load({str(tmp_path / "y.pt")!r}),
                           rtol=1e-4, atol=1e-5)
print(type(m).__name__, "flame" in sys.modules)
import flame  # transformers is loaded already: flame registers at once
print(type(AutoModelForCausalLM.from_pretrained({str(softpick)!r})).__name__)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "refused: ValueError True", lines
    assert lines[1] == "LlamaForCausalLM False"
    assert lines[2] == "FlameTransformerForCausalLM"


def test_import_flame_is_light_and_registers_when_transformers_loads():
    script = """
import sys
import flame
assert "transformers" not in sys.modules and "torch" not in sys.modules, sorted(sys.modules)
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
config = AutoConfig.for_model("flame_gated_deltanet", hidden_size=64, num_heads=2, head_dim=16)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
print("flame_transformer" in CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    registered, model_class = result.stdout.split()
    assert registered == "True" and model_class == "FlameGatedDeltaNetForCausalLM"
