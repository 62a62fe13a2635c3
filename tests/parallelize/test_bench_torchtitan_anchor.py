"""bench/torchtitan_anchor.py (torchtitan's own trainer at flame's transformer shape, a GPU benchmark) on the CPU:
the tiny shape trains end to end through torchtitan's main and reports torchtitan's own tokens/s and parameter
count, which is that of torchtitan's llama3 built at that shape; the mapping of transformer_340M onto torchtitan's
TransformerModelArgs gives the same parameter count as flame's model, the same SwiGLU width and unscaled RoPE."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "torchtitan_anchor.py"
sys.path.insert(0, str(BENCH.parent))

import torchtitan_anchor  # noqa: E402


def titan_params(kwargs: dict) -> int:
    from torchtitan.models.llama3 import Transformer

    with torch.device("meta"):
        model = Transformer(torchtitan_anchor.build_titan_model_args(kwargs))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_torchtitans_trainer_runs_the_tiny_shape_on_cpu(tmp_path):
    out = tmp_path / "anchor.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--dump_folder", str(tmp_path / "run"),
         "--json", str(out), "--timeout", "120"],
        capture_output=True, text=True, timeout=180, cwd=REPO, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    anchor = json.loads(out.read_text())
    log = Path(anchor["log"]).read_text()
    assert anchor["error"] is None and anchor["tokens_per_s"] > 0, log[-3000:]
    # 3 steps, the first left out; torchtitan's own step lines, through its main
    assert anchor["steps_timed"] == 2 and len(anchor["step_tps"]) == 3
    assert "Model llama3 flame_anchor size:" in log and "Training completed" in log
    assert "Preparing flame_corpus dataset from" in log and "train.jsonl.gz" in log
    # The workarounds the run took, each named
    assert anchor["shims"] == ["fake_process_group (flame.compat)", "torchtitan_cpu_device (flame.compat)"]
    assert anchor["peak_gib"] is None  # torchtitan logs no allocator statistics on a CPU
    # The printed row: torchtitan's parameter count, flame's, batch x seq, tokens/s
    row = [c.strip() for c in result.stdout.split("\n| torchtitan llama3 at ")[-1].split("\n")[0].split("|")]
    assert row[0] == "transformer_340M (tiny)" and row[3] == "2 x 64" and row[4] == "eager"
    assert float(row[7].replace(",", "")) > 0
    # The count torchtitan printed is its llama3 built at the tiny shape, and flame's model of the same config
    margs = torchtitan_anchor.read_config(torchtitan_anchor.DEFAULT_CONFIG, tiny=True)
    kwargs, _ = torchtitan_anchor.titan_model_args(margs)
    expected = titan_params(kwargs)
    assert anchor["params"] == expected == int(row[1].replace(",", "")) == anchor["flame_params"]


def test_transformer_340m_maps_onto_torchtitans_llama3():
    margs = torchtitan_anchor.read_config(torchtitan_anchor.DEFAULT_CONFIG)
    kwargs, unmatched = torchtitan_anchor.titan_model_args(margs)
    assert {k: kwargs[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps")} == {
        "dim": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 16, "vocab_size": 32000, "norm_eps": 1e-6,
    }  # fmt: skip
    # FLA's SwiGLU width (2/3 x 4 x 1024 rounded up to 256) is torchtitan's default rule
    assert (kwargs["multiple_of"], kwargs["ffn_dim_multiplier"]) == (256, None)
    assert torchtitan_anchor.titan_ffn_width(1024, 256, None) == 2816
    assert titan_params(kwargs) == torchtitan_anchor.flame_params(margs) == 373_867_520
    # Only the initialisation differs
    assert len(unmatched) == 1 and unmatched[0].startswith("initializer_range")

    # torchtitan's RoPE table under these args is plain RoPE (no llama3 frequency scaling), exactly
    from torchtitan.models.llama3.model.model import precompute_freqs_cis

    args = torchtitan_anchor.build_titan_model_args(kwargs)
    head_dim = args.dim // args.n_heads
    titan = precompute_freqs_cis(head_dim, 4096, args.rope_theta, args.rope_scaling_args)
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(4096), freqs).float()
    assert torch.equal(titan, torch.polar(torch.ones_like(angles), angles))
    scaled = precompute_freqs_cis(head_dim, 4096, args.rope_theta)  # torchtitan's default scaling differs
    assert not torch.equal(titan, scaled)


def test_other_widths_and_unmatched_fields_are_mapped_or_named(tmp_path):
    config = json.loads(torchtitan_anchor.DEFAULT_CONFIG.read_text())
    config.update(hidden_ratio=3, num_kv_heads=4, qk_norm=True, tie_word_embeddings=True, rope_theta=500000.0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    margs = torchtitan_anchor.read_config(path)
    kwargs, unmatched = torchtitan_anchor.titan_model_args(margs)
    width = margs.layer_dims(0).intermediate_size  # 2048: not torchtitan's default for dim 1024
    assert width == 2048 and torchtitan_anchor.titan_ffn_width(1024, 256, None) != width
    assert (
        torchtitan_anchor.titan_ffn_width(1024, kwargs["multiple_of"], kwargs["ffn_dim_multiplier"]) == width
    )
    assert kwargs["n_kv_heads"] == 4 and kwargs["rope_theta"] == 500000.0
    assert [line.split(" ")[0] for line in unmatched] == [
        "initializer_range",
        "qk_norm",
        "tie_word_embeddings",
    ]
    # RoPE stays unscaled at this theta too: every wavelength below torchtitan's high-frequency bound
    rope = kwargs["rope_scaling_args"]
    longest = 2 * math.pi * 500000.0 ** (62 / 64)
    assert longest < rope["original_max_position_embeddings"] / rope["high_freq_factor"]
