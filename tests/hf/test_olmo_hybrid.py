"""--format olmo_hybrid: flame hybrids with OLMo's attention blocks as transformers' OlmoHybridForCausalLM.

A flame Gated DeltaNet hybrid whose attention specs say ``"norm_order": "post"`` and ``"qk_norm": true,
"qk_norm_scope": "full"`` (and whose Gated DeltaNet output norm uses OLMo's eps 1e-5) exports as ``olmo_hybrid``;
a fresh process with neither flame nor FLA importable loads it with ``AutoModelForCausalLM`` and gets flame's
logits (float32, rtol 1e-4, atol 1e-5). Without FLA, transformers runs its own PyTorch reference of the gated delta
rule and of the short convolution, which the test checks it did. Other models are refused with the reason.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from flame.cli import convert_dcp_to_hf, convert_hf_to_dcp
from flame.models.gated_deltanet.state_dict_adapter import OlmoHybridAdapter, olmo_linear_incompatibilities
from tests.utils.helpers import REPO, save_checkpoint, tiny_model, tokens

OLMO_ATTN = {"num_heads": 4, "qk_norm": True, "qk_norm_scope": "full", "norm_order": "post"}
OLMO = {"norm_eps": 1e-5, "attn": {"layers": [1], **OLMO_ATTN}}
CASES = {
    "one-attention-layer": OLMO,
    "pattern-gqa-tied-theta": {
        "num_hidden_layers": 4, "norm_eps": 1e-6, "output_norm_eps": 1e-5, "tie_word_embeddings": True,
        "allow_neg_eigval": True, "intermediate_size": 96,
        "attn": {"every": 2, "offset": 1, **OLMO_ATTN, "num_kv_heads": 2, "rope_theta": 500000.0},
    },
    "grouped-value-heads": {**OLMO, "num_v_heads": 4, "expand_v": 1},
}  # fmt: skip
REFUSED = {
    "pre-norm-per-head": (
        {"norm_eps": 1e-5, "attn": {"layers": [1], "num_heads": 4, "qk_norm": True}},
        "norm_order pre (OLMo's attention blocks are norm_order post); "
        "attention layers [1]: qk_norm_scope head",
    ),
    "no-qk-norm": ({"norm_eps": 1e-5, "attn": {"layers": [1], "num_heads": 4, "norm_order": "post"}}, "no qk_norm"),
    "window": ({**OLMO, "attn": {**OLMO["attn"], "window_size": 8}}, "window_size 8"),
    "softpick": ({**OLMO, "attn": {**OLMO["attn"], "attn_impl": "parallel_softpick_attn"}}, "attn_impl"),
    "qkv-bias": ({**OLMO, "attn": {**OLMO["attn"], "qkv_bias": True}}, "qkv_bias"),
    "two-shapes": (
        {"num_hidden_layers": 3, "norm_eps": 1e-5,
         "attn": [{"layers": [1], **OLMO_ATTN}, {"layers": [2], **OLMO_ATTN, "rope_theta": 5e5}]},
        "attention specs differ",
    ),
    "output-norm-eps": ({**OLMO, "norm_eps": 1e-6}, "output norm eps 1e-06"),
    "no-attention": ({"norm_eps": 1e-5}, "no attention layer"),
    "no-gated-deltanet": ({"norm_eps": 1e-5, "attn": {"layers": [0, 1], **OLMO_ATTN}}, "no Gated DeltaNet layer"),
    "no-gate": ({**OLMO, "use_gate": False}, "use_gate false"),
}  # fmt: skip

# Run in a fresh process: flame and FLA cannot be imported, so nothing but transformers defines the model.
LOAD = textwrap.dedent("""
    import inspect, json, sys
    sys.modules["fla"] = sys.modules["flame"] = None
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as olmo

    kernels = {}
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):  # transformers >= 5.17's kernel hooks
        if hasattr(olmo, name):
            used = inspect.getclosurevars(getattr(olmo, name)).nonlocals.get("implementation", getattr(olmo, name))
            kernels[name] = used.__module__
    report = {"kernels": kernels}
    for folder in sys.argv[1:]:
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        with torch.no_grad():
            torch.save(model.eval()(torch.load(f"{folder}/x.pt")).logits, f"{folder}/logits.pt")
        report[folder] = {"module": type(model).__module__, "class": type(model).__name__,
                          "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"])}
    print(json.dumps(report))
""")


def olmo_model(**overrides):
    """A tiny hybrid whose norm weights are not all ones, so that a misplaced norm weight changes the logits."""
    model = tiny_model("gated_deltanet", **overrides)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=generator)
    return model


def export(tmp_path, name, overrides, fmt="olmo_hybrid"):
    model = olmo_model(**overrides)
    save_checkpoint(tmp_path / name, model, step=1)
    out = tmp_path / f"{name}-hf"
    code = convert_dcp_to_hf.main(["--path", str(tmp_path / name), "--output", str(out), "--format", fmt])
    return model, out, code


def test_olmo_hybrid_export_matches_flame_logits_without_flame_or_fla(tmp_path):
    x = tokens(length=80)  # beyond one 64-token chunk of the gated delta rule
    models, folders = {}, []
    for case, overrides in CASES.items():
        models[case], out, code = export(tmp_path, case, overrides)
        assert code == 0
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "olmo_hybrid" and config["architectures"] == ["OlmoHybridForCausalLM"]
        torch.save(x, out / "x.pt")
        folders.append(str(out))
    assert json.loads((tmp_path / "pattern-gqa-tied-theta-hf/config.json").read_text())["layer_types"] == [
        "linear_attention", "full_attention", "linear_attention", "full_attention"
    ]  # fmt: skip

    result = subprocess.run(
        [sys.executable, "-c", LOAD, *folders], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # transformers' own PyTorch paths ran (with FLA importable it would take FLA's Triton kernels).
    assert all(module.startswith("transformers.") for module in report["kernels"].values()), report
    for case, folder in zip(CASES, folders):
        loaded = report[folder]
        assert loaded["module"].startswith("transformers.models.olmo_hybrid"), loaded
        assert loaded["class"] == "OlmoHybridForCausalLM" and loaded["missing"] == loaded["unexpected"] == []
        with torch.no_grad():
            expected = models[case](x)
        logits = torch.load(f"{folder}/logits.pt")
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5, msg=case)


@pytest.mark.parametrize("case", list(REFUSED))
def test_olmo_hybrid_export_is_refused_with_the_reason(tmp_path, capsys, case):
    overrides, reason = REFUSED[case]
    _, out, code = export(tmp_path, "dump", overrides)
    assert code == 2 and not out.exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: cannot export this gated_deltanet model as olmo_hybrid") and reason in line


def test_olmo_hybrid_round_trip_through_dcp(tmp_path):
    _, first, code = export(tmp_path, "dump", CASES["pattern-gqa-tied-theta"])
    assert code == 0
    step0 = tmp_path / "again" / "checkpoint" / "step-0"
    assert convert_hf_to_dcp.main(["--model", str(first), "--checkpoint", str(step0)]) == 0
    second = tmp_path / "second"
    assert convert_dcp_to_hf.main(["--path", str(tmp_path / "again"), "--output", str(second),
                                   "--format", "olmo_hybrid"]) == 0  # fmt: skip
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def fuse_convolutions(hf: dict, prefix: str) -> None:
    """transformers >= 5.17's layout: the q/k/v short convolutions of a layer as one conv1d."""
    hf[f"{prefix}linear_attn.conv1d.weight"] = torch.cat(
        [hf.pop(f"{prefix}linear_attn.{x}_conv1d.weight") for x in "qkv"]
    )


def test_olmo_hybrid_reads_the_fused_convolution_layout():
    model = olmo_model(**CASES["pattern-gqa-tied-theta"])
    adapter = OlmoHybridAdapter(model.args)
    hf = adapter.to_hf(model.state_dict())
    fuse_convolutions(hf, "model.layers.0.")
    back = adapter.from_hf(hf)
    assert back.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key


def test_olmo_hybrid_without_rope_is_not_read(tmp_path, capsys):
    _, out, code = export(tmp_path, "dump", OLMO)
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    # How transformers spells NoPE (released OLMo hybrid checkpoints); a null rope_parameters means the default RoPE.
    nope = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": None}}
    (out / "config.json").write_text(json.dumps(nope))
    step0 = tmp_path / "again" / "checkpoint" / "step-0"
    assert convert_hf_to_dcp.main(["--model", str(out), "--checkpoint", str(step0)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: flame cannot build this olmo_hybrid model: no RoPE") and not step0.exists()


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_linear_attention_block_matches_olmo_hybrid(neg_eigval, monkeypatch):
    import inspect

    from transformers import OlmoHybridConfig
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridLinearAttentionDecoderLayer

    # With FLA installed transformers runs FLA's Triton kernel here, which needs a GPU: use its PyTorch reference.
    reference = inspect.unwrap(modeling_olmo_hybrid.torch_chunk_gated_delta_rule)
    monkeypatch.setattr(modeling_olmo_hybrid, "torch_chunk_gated_delta_rule", reference)

    model = olmo_model(**OLMO, allow_neg_eigval=neg_eigval, intermediate_size=96)
    assert olmo_linear_incompatibilities(model.args) == []
    block = model.layers["0"]
    prefix = "model.layers.0."
    hf = OlmoHybridAdapter(model.args).to_hf(model.state_dict())
    fuse_convolutions(hf, prefix)
    hf_block = {k.removeprefix(prefix): v for k, v in hf.items() if k.startswith(prefix)}
    config = OlmoHybridConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=neg_eigval, rms_norm_eps=1e-5, hidden_act="silu",
    )  # fmt: skip
    olmo = OlmoHybridLinearAttentionDecoderLayer(config, layer_idx=0).eval()
    olmo.load_state_dict(hf_block, strict=True)
    x = torch.randn(2, 80, 64, generator=torch.Generator().manual_seed(0))  # beyond one 64-token chunk
    with torch.no_grad():
        expected = block(x, torch.arange(80).expand(2, -1))
        torch.testing.assert_close(olmo(x), expected, rtol=1e-4, atol=1e-5)


def test_folder_saved_by_transformers_imports_to_dcp_with_its_logits(tmp_path, monkeypatch):
    """transformers' own OlmoHybridForCausalLM, saved by the installed transformers (>= 5.17 writes the released
    checkpoints' names: attention_layer_norm, feedforward_layer_norm, q/k/v_conv1d), imported to DCP: flame's model
    from the written model_config.json and checkpoint gives transformers' logits (float32, rtol 1e-4, atol 1e-5)."""
    import inspect

    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid

    from flame.checkpoint.dcp_io import load_model_tensors
    from flame.hf.safetensors_io import load_safetensors
    from flame.models import build_model, load_model_args

    # With FLA installed transformers runs FLA's Triton kernel here, which needs a GPU: use its PyTorch reference.
    reference = inspect.unwrap(modeling_olmo_hybrid.torch_chunk_gated_delta_rule)
    monkeypatch.setattr(modeling_olmo_hybrid, "torch_chunk_gated_delta_rule", reference)
    torch.manual_seed(3)
    config = OlmoHybridConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=12,
        linear_allow_neg_eigval=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        pad_token_id=None, bos_token_id=None, eos_token_id=1,
    )  # fmt: skip
    olmo = OlmoHybridForCausalLM(config).eval()
    with torch.no_grad():  # norm weights not all ones, so that a misplaced norm changes the logits
        for name, param in olmo.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    olmo.save_pretrained(tmp_path / "hf")
    saved = load_safetensors(tmp_path / "hf")  # the layout this test is about: names and equal conv chunks
    assert "model.layers.0.attention_layer_norm.weight" in saved
    assert saved["model.layers.0.linear_attn.k_conv1d.weight"].shape[0] == (24 + 24 + 48) // 3
    step0 = tmp_path / "dump" / "checkpoint" / "step-0"
    assert convert_hf_to_dcp.main(["--model", str(tmp_path / "hf"), "--checkpoint", str(step0)]) == 0
    args, _ = load_model_args(step0 / "model_config.json")
    model = build_model(args)
    load_model_tensors(step0, model.state_dict())
    x = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(4))  # beyond one 64-token chunk
    with torch.no_grad():
        torch.testing.assert_close(model(x), olmo(x).logits, rtol=1e-4, atol=1e-5)
