"""The default export format (auto) loads on the machine that trained it: transformers' own classes where they
compute the model exactly (no flame, FLA or flash-attn import), then FLA's format, then flame's own."""

import json
import subprocess
import sys

import pytest
import torch

from flame.cli import convert_dcp_to_hf
from flame.hf.formats import export_adapter
from flame.models import build_model, load_model_args
from tests.utils.helpers import REPO, save_checkpoint, tokens


@pytest.mark.parametrize(
    "config, expected",
    [
        ("flame/assets/tiny.json", "llama"),  # the default CPU job's model
        ("configs/transformer_340M.json", "llama"),
        ("configs/olmo_hybrid_7b.json", "olmo_hybrid"),
        ("configs/gated_deltanet_340M.json", "fla"),  # no attention layer: not an OLMo hybrid
        ("configs/delta_net_340M.json", "fla"),
        ("configs/softpick_transformer_340M.json", "flame"),
    ],
)
def test_auto_prefers_transformers_own_classes_then_fla_then_flame(config, expected):
    args, _ = load_model_args(REPO / config)
    adapter, note = export_adapter(args)
    assert adapter.format == expected
    assert (note is not None) == (expected == "flame")


def test_default_cpu_job_export_loads_and_generates_with_plain_transformers(tmp_path):
    """The embedded default job's model, exported as train.sh does at the end of a run, loads in a fresh process
    that imports neither flame nor FLA, gives flame's logits and generates."""
    args, _ = load_model_args(REPO / "flame/assets/tiny.json")
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    model.eval()
    save_checkpoint(tmp_path / "dump", model, step=30)
    assert convert_dcp_to_hf.main(["--path", str(tmp_path / "dump"), "--step", "-1", "--after_training"]) == 0
    assert json.loads((tmp_path / "dump" / "config.json").read_text())["model_type"] == "llama"
    x = tokens(length=32)
    torch.save(x, tmp_path / "x.pt")
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = {str(tmp_path / "dump")!r}
model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
with torch.no_grad():
    torch.save(model(torch.load({str(tmp_path / "x.pt")!r})).logits, {str(tmp_path / "y.pt")!r})
prompt = tokenizer("The", return_tensors="pt")
out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
print(out.shape[1] - prompt["input_ids"].shape[1], any(m.split(".")[0] in ("flame", "fla") for m in sys.modules))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["5", "False"]
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "y.pt"), model(x))
