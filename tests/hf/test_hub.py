"""Hub names for --model.config and the converters, read from the local HF cache; one line when a name is neither
on disk nor in the cache and the hub cannot be asked (offline)."""

import json
import os
import re
import subprocess

import pytest

from flame.cli import convert_dcp_to_hf, convert_hf_to_dcp
from flame.hf.hub import is_hub_name
from tests.utils.helpers import REPO, TOKENIZER, save_checkpoint, tiny_model
from tests.utils.hub_cache import add_to_cache

TOKENIZER_FILES = {name: TOKENIZER / name for name in ("tokenizer.json", "tokenizer_config.json")}


@pytest.mark.parametrize(
    "value, hub",
    [("fla-hub/transformer-1.3B-100B", True), ("configs/transformer_340M.json", False), ("./a/b", False),
     ("/abs/path", False), ("a/b/c", False), ("name", False)],
)  # fmt: skip
def test_what_counts_as_a_hub_name(value, hub):
    assert is_hub_name(value) is hub


def test_model_config_hub_name_dry_runs_from_the_cache(offline_cache, tmp_path):
    add_to_cache(offline_cache, "acme/tiny", {"config.json": REPO / "flame/assets/tiny.json"})
    env = {**os.environ, "HF_HUB_CACHE": str(offline_cache), "HF_HUB_OFFLINE": "1"}
    run = ["bash", str(REPO / "train.sh"), "--job.dry_run", "--model.config"]
    result = subprocess.run(
        [*run, "acme/tiny"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    merged = json.loads(result.stdout[: result.stdout.index("params:")])
    assert merged["model"]["config"].startswith(f"{offline_cache}/models--acme--tiny/snapshots/")
    result = subprocess.run(
        [*run, "acme/absent"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: model config 'acme/absent' is not a local path and not in the HF cache (HF_HUB_OFFLINE is set); "
        "download it where the hub is reachable (huggingface-cli download acme/absent) or pass a local path"
    ]


def test_converters_take_hub_names(offline_cache, tmp_path):
    model = tiny_model("transformer")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(model.args.to_dict()))
    add_to_cache(offline_cache, "acme/tiny", {"config.json": config, **TOKENIZER_FILES})
    save_checkpoint(tmp_path / "dump", model, step=3, tokenizer=None)
    hf = tmp_path / "hf"
    argv = [
        "--path",
        str(tmp_path / "dump"),
        "--output",
        str(hf),
        "--config",
        "acme/tiny",
        "--tokenizer",
        "acme/tiny",
    ]
    assert convert_dcp_to_hf.main(argv) == 0
    assert (hf / "tokenizer.json").is_file() and (hf / "model.safetensors").is_file()

    add_to_cache(offline_cache, "acme/tiny-hf", {p.name: p for p in hf.iterdir()})
    step0 = tmp_path / "continued" / "checkpoint" / "step-0"
    assert convert_hf_to_dcp.main(["--model", "acme/tiny-hf", "--checkpoint", str(step0)]) == 0
    assert (step0 / "model_config.json").is_file()


@pytest.mark.parametrize(
    "tool, argv, what",
    [
        (convert_hf_to_dcp, ["--model", "acme/absent", "--checkpoint", "{tmp}/c/step-0"], "HF model"),
        (convert_dcp_to_hf, ["--path", "{tmp}/dump", "--tokenizer", "acme/absent"], "tokenizer"),
    ],
)
def test_converters_say_in_one_line_when_a_hub_name_is_absent_offline(
    offline_cache, tmp_path, capsys, tool, argv, what
):
    save_checkpoint(tmp_path / "dump", tiny_model("transformer"), step=3)
    assert tool.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"error: {what} 'acme/absent' is not a local path and not in the HF cache \(.*", err)
