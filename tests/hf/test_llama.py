"""--format llama: transformer models as transformers' LlamaForCausalLM, which runs with no flame or FLA import
(tests/hf/test_flame_types.py loads one in a fresh process); logits equal flame's up to float32 rounding."""

import json

import pytest
import torch

from flame.cli import convert_dcp_to_hf, convert_hf_to_dcp
from tests.utils.helpers import save_checkpoint, tiny_model, tokens

CASES = {
    "gqa": {},
    "mha-tied-theta": {"num_kv_heads": 4, "tie_word_embeddings": True, "rope_theta": 500000.0},
    "explicit-width": {"intermediate_size": 96, "hidden_ratio": None},
}
REFUSED = {
    "softpick": ({"attn_impl": "parallel_softpick_attn"}, "attn_impl"),
    "qk-norm": ({"qk_norm": True}, "qk_norm"),
    "window": ({"window_size": 8}, "sliding window"),
    "qkv-bias": ({"qkv_bias": True}, "qkv_bias"),
}


def export_llama(tmp_path, overrides):
    model = tiny_model("transformer", **overrides)
    save_checkpoint(tmp_path / "dump", model, step=1)
    out = tmp_path / "llama"
    code = convert_dcp_to_hf.main(
        ["--path", str(tmp_path / "dump"), "--output", str(out), "--format", "llama"]
    )
    return model, out, code


@pytest.mark.parametrize("case", list(CASES))
def test_llama_export_matches_flame_logits(tmp_path, case):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model, out, code = export_llama(tmp_path, CASES[case])
    assert code == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    llama = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(llama, LlamaForCausalLM)
    x = tokens(length=40)
    with torch.no_grad():
        torch.testing.assert_close(llama(x).logits, model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", list(REFUSED))
def test_llama_refuses_what_it_cannot_express(tmp_path, capsys, case):
    overrides, reason = REFUSED[case]
    _, out, code = export_llama(tmp_path, overrides)
    assert code == 2 and not out.exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: cannot export this transformer model as llama") and reason in line


def test_llama_round_trip_through_dcp(tmp_path):
    _, first, code = export_llama(tmp_path, {"tie_word_embeddings": True})
    assert code == 0
    step0 = tmp_path / "again" / "checkpoint" / "step-0"
    assert convert_hf_to_dcp.main(["--model", str(first), "--checkpoint", str(step0)]) == 0
    second = tmp_path / "second"
    assert convert_dcp_to_hf.main(["--path", str(tmp_path / "again"), "--output", str(second),
                                   "--format", "llama"]) == 0  # fmt: skip
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_folder_saved_by_transformers_imports_to_dcp_with_its_logits(tmp_path):
    """transformers' own LlamaForCausalLM, saved by the installed transformers, imported to DCP: flame's model from
    the written model_config.json and checkpoint gives transformers' logits (float32, rtol 1e-4, atol 1e-5)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flame.checkpoint.dcp_io import load_model_tensors
    from flame.models import build_model, load_model_args

    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    llama = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norm weights not all ones, so that a misplaced norm changes the logits
        for name, param in llama.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    llama.save_pretrained(tmp_path / "hf")
    step0 = tmp_path / "dump" / "checkpoint" / "step-0"
    assert convert_hf_to_dcp.main(["--model", str(tmp_path / "hf"), "--checkpoint", str(step0)]) == 0
    args, _ = load_model_args(step0 / "model_config.json")
    model = build_model(args)
    load_model_tensors(step0, model.state_dict())
    x = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(x), llama(x).logits, rtol=1e-4, atol=1e-5)
