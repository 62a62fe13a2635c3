"""python -m flame.diagnostics end to end on tiny checkpoints: a DCP checkpoint and its HF export give the same
numbers, the three files and one table; a hybrid counts only its attention layers; bad input is one line, exit 2."""

import json

import pytest
import torch

from flame.cli import convert_dcp_to_hf
from flame.diagnostics.__main__ import main
from flame.diagnostics.inputs import corpus_documents, token_sequences
from flame.hf.export import load_tokenizer
from tests.utils.helpers import TOKENIZER, save_checkpoint, tiny_model

FAST = [
    "--seq_len",
    "24",
    "--num_sequences",
    "2",
    "--passkey_lengths",
    "90,120",
    "--passkey_trials",
    "1",
    "--device",
    "cpu",
]
HYBRID = {"attn": {"layers": [1], "num_heads": 4}}


def diagnose(capsys, checkpoint, out, *extra) -> tuple[dict, str]:
    assert main(["--checkpoint", str(checkpoint), "--out", str(out), *FAST, *extra]) == 0
    printed = capsys.readouterr().out
    for name in ("diagnostics.json", "diagnostics.md", "diagnostics.png"):
        assert (out / name).stat().st_size > 0, name
    return json.loads((out / "diagnostics.json").read_text()), printed


def test_dcp_checkpoint_writes_the_files_and_prints_one_table(tmp_path, capsys):
    model = tiny_model("transformer", attn_impl="parallel_softpick_attn")
    save_checkpoint(tmp_path / "run", model, step=3)
    result, printed = diagnose(capsys, tmp_path / "run", tmp_path / "out")
    assert printed.count("| layer ") == 1 and printed.count("| context length ") == 1
    assert (tmp_path / "out" / "diagnostics.md").read_text() in printed
    assert result["source"].endswith("step-3") and result["attention_layers"] == [0, 1]
    assert result["attention_heads"] == 8
    per_head = [a for entry in result["layers"] for a in entry["attention"]["first_token_attention"]]
    assert result["sink_heads"] == sum(a > 0.3 for a in per_head)
    assert result["sink_rate"] == result["sink_heads"] / 8
    assert [(p["length"], p["trials"]) for p in result["passkey"]] == [(90, 1), (120, 1)]
    # max |h| per layer is that of the blocks' outputs on the same sequences, computed here directly.
    sequences = token_sequences(corpus_documents(), load_tokenizer(str(TOKENIZER)), 24, 2)
    outputs = {name: [] for name in model.layers}
    for name, block in model.layers.items():
        block.register_forward_hook(lambda module, args, out, name=name: outputs[name].append(out))
    with torch.no_grad():
        model(sequences)
    for entry in result["layers"]:
        expected = torch.cat(outputs[str(entry["layer"])]).abs().max()
        assert entry["max_abs"] == pytest.approx(float(expected), rel=1e-6)
        assert entry["attention"]["zero_fraction"] > 0  # softpick of a random model: some scores <= 0


def test_hybrid_counts_only_attention_layers_and_its_hf_export_gives_the_same_numbers(tmp_path, capsys):
    save_checkpoint(tmp_path / "run", tiny_model("gated_deltanet", **HYBRID))
    from_dcp, printed = diagnose(capsys, tmp_path / "run", tmp_path / "dcp")
    assert "attention layer 1 " in printed
    assert from_dcp["attention_layers"] == [1] and from_dcp["attention_heads"] == 4
    assert from_dcp["layers"][0]["mixer"] == "GatedDeltaNet" and from_dcp["layers"][0]["attention"] is None
    assert from_dcp["layers"][1]["mixer"] == "attention (softmax)"
    assert convert_dcp_to_hf.main(["--path", str(tmp_path / "run"), "--output", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    from_hf, _ = diagnose(capsys, tmp_path / "hf", tmp_path / "from_hf")
    assert from_hf["source"] == f"HF export {tmp_path / 'hf'} (gated_deltanet)"
    assert from_hf["layers"] == from_dcp["layers"] and from_hf["passkey"] == from_dcp["passkey"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "{tmp}/missing"], "the checkpoint folder {tmp}/missing does not exist"),
        (
            ["--checkpoint", "{tmp}", "--passkey_lengths", "256,x"],
            "--passkey_lengths must be comma-separated",
        ),
        (["--checkpoint", "{tmp}", "--step", "7"], "{tmp} holds no step-<N> checkpoint and no HF export"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, args, message):
    assert main([arg.format(tmp=tmp_path) for arg in args]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {captured.err.removeprefix('error: ').strip()}\n"
    assert message.format(tmp=tmp_path) in captured.err and captured.out == ""
