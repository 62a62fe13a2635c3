"""Tiny configs of transformers' own causal LMs for the generic family (vocab 4096: flame's default tokenizer)."""

import json
import os
import subprocess
from pathlib import Path

import torch

from tests.trainer_helpers import dry_run_output, free_port

REPO = Path(__file__).resolve().parents[3]

SHAPE = {"vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
CONFIGS = {
    "llama": {"model_type": "llama", **SHAPE},
    "qwen3": {"model_type": "qwen3", **SHAPE, "head_dim": 8, "tie_word_embeddings": True},
    "olmo2": {"model_type": "olmo2", **SHAPE},
}


def write_config(folder: Path, name: str, **overrides) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**CONFIGS[name], **overrides}))
    return path


def upstream_params(config: dict) -> int:
    """Parameter count of transformers' own class for the config, built by transformers alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **values))
    return sum(p.numel() for p in model.parameters())


def dry_run_params(capsys, *flags: str) -> int:
    """The ``params:`` line of train.sh's pre-flight dry run, run in this process."""
    (line,) = [line for line in dry_run_output(capsys, *flags).splitlines() if line.startswith("params: ")]
    return int(line.removeprefix("params: "))


def train_sh(
    dump: Path | None, *args: str, env: dict | None = None, cwd: Path = REPO, export_hf: bool = True
):
    """train.sh on 2 CPU ranks (a free rendezvous port: other test processes may share the machine)."""
    dump_flags = ["--job.dump_folder", str(dump)] if dump else []
    return subprocess.run(
        ["bash", str(REPO / "train.sh"), *dump_flags, "--metrics.log_freq", "1", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
        env={**os.environ, "NGPU": "2", "MASTER_PORT": str(free_port()),
             "FLAME_EXPORT_HF": "1" if export_hf else "0", **(env or {})},
    )  # fmt: skip
