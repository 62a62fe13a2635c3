"""flame's HF exports on the GPU: FLA's own classes (Triton kernels) load the ``fla`` format and compute the logits
of flame's training model (their attention layers flame's where flash-attn does not import, as the generic family
builds them); flame's types, Llama and OLMo-hybrid exports do too. Reference: flame's model on the CPU (PyTorch
path, float32); candidates run on the GPU under bf16 autocast, limit as in test_model_parity.py."""

import json

import pytest
import torch

from flame.cli import convert_dcp_to_hf
from flame.compat import fla_layers_on_flame
from flame.models.generic.model import FLA_LAYER_REPLACEMENTS
from tests.utils.helpers import save_checkpoint, tiny_model, tokens

LIMIT = 0.02
GDN = {"hidden_size": 128, "num_heads": 2, "head_dim": 64}
CASES = {
    "gated_deltanet": ("gated_deltanet", GDN, "fla"),
    "gated_deltanet++": ("gated_deltanet", {**GDN, "allow_neg_eigval": True}, "fla"),
    "gated_deltanet-gva": ("gated_deltanet", {**GDN, "num_v_heads": 4, "expand_v": 1}, "fla"),
    "delta_net": ("delta_net", {"hidden_size": 128, "num_heads": 2}, "fla"),
    "transformer": ("transformer", {"hidden_size": 128}, "fla"),
    "gdn-hybrid": ("gated_deltanet", {**GDN, "attn": {"layers": [1], "num_heads": 4}}, "fla"),
    "flame-softpick": ("transformer", {"hidden_size": 128, "attn_impl": "parallel_softpick_attn"}, "flame"),
    "flame-gdn-hybrid-qk-norm": ("gated_deltanet", {**GDN, "attn": {"layers": [1], "num_heads": 4,
                                                                     "qk_norm": True}}, "flame"),
    "llama": ("transformer", {"hidden_size": 128}, "llama"),
    "olmo_hybrid": ("gated_deltanet", {**GDN, "norm_eps": 1e-5, "attn": {"layers": [1], "num_heads": 4,
                    "qk_norm": True, "qk_norm_scope": "full", "norm_order": "post"}}, "olmo_hybrid"),
}  # fmt: skip


def err_ratio(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((ref - out).norm() / (ref.norm() + 1e-12)).item()


@pytest.mark.parametrize("model_type, overrides, fmt", [CASES[k] for k in CASES], ids=list(CASES))
def test_exported_model_on_gpu_matches_flame(tmp_path, model_type, overrides, fmt):
    import fla.models  # noqa: F401  (FLA's model types)
    from transformers import AutoModelForCausalLM

    import flame  # noqa: F401  (flame's model types)

    model = tiny_model(model_type, **overrides)
    save_checkpoint(tmp_path / "dump", model, step=1)
    out = tmp_path / "hf"
    assert (
        convert_dcp_to_hf.main(["--path", str(tmp_path / "dump"), "--output", str(out), "--format", fmt]) == 0
    )
    config = json.loads((out / "config.json").read_text())
    x = tokens(length=100)  # past one 64-token chunk
    with torch.no_grad():
        reference = model(x)
        with fla_layers_on_flame(FLA_LAYER_REPLACEMENTS):
            hf = AutoModelForCausalLM.from_pretrained(out).cuda().eval()
        assert (
            type(hf).__module__.split(".")[0]
            == {"fla": "fla", "flame": "flame", "llama": "transformers", "olmo_hybrid": "transformers"}[fmt]
        )
        assert config["model_type"] == hf.config.model_type
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = hf(x.cuda()).logits.float().cpu()
    assert err_ratio(reference, logits) < LIMIT
