"""flame.train.prewarm: one block of each kind of the job's model, forward and backward at the job's micro-batch
shape, as the ranks will run them (on the CPU here; tests/gpu/test_prewarm.py checks that the ranks then find every
kernel it compiled)."""

import json
from pathlib import Path

import pytest
import torch

from flame.config import parse_args
from flame.models.layers.attention import Attention
from flame.models.layers.gated_deltanet import GatedDeltaNet
from flame.train import prewarm
from tests.models.helpers import tiny_args, tiny_model

REPO = Path(__file__).resolve().parents[2]

# A hybrid: Gated DeltaNet blocks with attention at layers 3 and 7 (two kinds of block in eight).
HYBRID = {
    "head_dim": 8,
    "num_heads": 2,
    "num_hidden_layers": 8,
    "attn": {"every": 4, "offset": 3, "num_heads": 4},
}


def test_one_block_of_each_kind_in_model_order():
    kinds = prewarm.block_kinds(tiny_model("gated_deltanet", **HYBRID))
    assert list(kinds) == ["0", "3"]
    assert isinstance(kinds["0"].attn, GatedDeltaNet) and isinstance(kinds["3"].attn, Attention)
    assert list(prewarm.block_kinds(tiny_model("transformer", num_heads=2, num_hidden_layers=3))) == ["0"]


def hybrid_job(tmp_path: Path, *flags: str):
    config = tmp_path / "hybrid.json"
    config.write_text(json.dumps(tiny_args("gated_deltanet", **HYBRID).to_dict()))
    return parse_args(["--model.config", str(config), "--training.seq_len", "80", "--training.batch_size", "2",
                       *flags])  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "how", "shape"),
    [
        ([], "eager", "2 x 80"),
        (["--compile.enable"], "traced by dynamo", "2 x 80"),
        (
            ["--training.varlen", "--training.batch_size", "1", "--training.context_len", "48"],
            "eager",
            "1 x 80",
        ),
    ],
)
def test_each_kind_runs_forward_and_backward(tmp_path, monkeypatch, flags, how, shape):
    ran = {}
    block_kinds = prewarm.block_kinds

    def kept(model):
        ran.update(block_kinds(model))
        return ran

    monkeypatch.setattr(prewarm, "block_kinds", kept)
    summary = prewarm.prewarm(hybrid_job(tmp_path, *flags), torch.device("cpu"))
    assert summary == (
        f"gated_deltanet: layers 0 (GatedDeltaNet), 3 (Attention) forward and backward at {shape}, {how}"
    )
    for block in ran.values():
        grads = [p.grad for p in block.parameters()]
        assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize(
    ("device_type", "world_size", "flags", "expected"),
    [
        ("cpu", 8, [], (None, None)),  # float32 throughout
        ("cuda", 1, [], (None, torch.bfloat16)),  # autocast over float32 parameters
        ("cuda", 8, [], (torch.bfloat16, None)),  # FSDP casts the parameters
        ("cuda", 8, ["--parallelism.data_parallel_replicate_degree", "8",
                     "--parallelism.data_parallel_shard_degree", "1"], (None, torch.bfloat16)),  # DDP
    ],
)  # fmt: skip
def test_the_ranks_precision(tmp_path, device_type, world_size, flags, expected):
    from flame.models import load_model_args
    from flame.parallelize.checks import check_parallelism

    job = hybrid_job(tmp_path, *flags)
    args, _ = load_model_args(job.model.config)
    assert (
        prewarm.precision(job, check_parallelism(job, args, world_size=world_size), device_type) == expected
    )


def test_jobs_whose_ranks_reshape_the_blocks_and_other_families_are_left_out(tmp_path):
    job = hybrid_job(tmp_path, "--parallelism.tensor_parallel_degree", "2")
    assert prewarm.prewarm(job, torch.device("cpu"), world_size=2) == (
        "nothing to compile ahead: the ranks reshape the blocks (tp > 1)"
    )
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 64}))  # fmt: skip
    assert prewarm.prewarm(parse_args(["--model.config", str(llama)]), torch.device("cpu")) == (
        "nothing to compile ahead: LlamaForCausalLM is not one of flame's decoder families"
    )


def test_a_failure_is_one_line_and_exit_status_1(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert prewarm.main(["--model.config", str(missing)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("prewarm: stopped: ") and "missing.json" in out[0]


def test_its_log_has_the_kernels_it_tuned(monkeypatch, capsys):
    """flame.ops.autotune's lines, as the prewarm's Triton calls write them on a GPU, come before its summary."""
    import logging

    def prewarm_that_tunes(job_config, device, world_size):
        logging.getLogger("flame.ops.autotune").info(
            "tuned Triton kernel _dhu_kernel over 2 settings in 1.5 s"
        )
        return "gated_deltanet: layers 0 (GatedDeltaNet) forward and backward at 8 x 2048, eager"

    monkeypatch.setattr(prewarm, "prewarm", prewarm_that_tunes)
    handlers, level = list(prewarm.TUNING_LOG.handlers), prewarm.TUNING_LOG.level
    assert prewarm.main(["--model.config", str(REPO / "configs/gated_deltanet_340M.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "prewarm: tuned Triton kernel _dhu_kernel over 2 settings in 1.5 s"
    assert len(out) == 2 and out[1].startswith("prewarm: gated_deltanet: layers 0")
    assert prewarm.TUNING_LOG.handlers == handlers  # the log's handler and level go with the call
    assert prewarm.TUNING_LOG.level == level


@pytest.mark.parametrize("prewarm_flag", ["1", "0"])
def test_train_sh_starts_it_where_a_gpu_is_listed_and_trains_whatever_it_does(tmp_path, prewarm_flag):
    """train.sh on a machine whose nvidia-smi lists a GPU (a stand-in here, with no CUDA behind it) starts the
    prewarm beside the ranks, its one line in <dump_folder>/logs/prewarm.log; the prewarm stops (no CUDA device),
    and training goes on. FLAME_PREWARM=0 starts none."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in (UUID: GPU-0)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    dump = tmp_path / "dump"
    result = subprocess.run(
        ["bash", str(REPO / "train.sh"), "--job.dump_folder", str(dump), "--training.steps", "1",
         "--checkpoint.no-enable"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FLAME_EXPORT_HF": "0",
             "FLAME_PREWARM": prewarm_flag},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "step 1/1" in result.stdout
    log = dump / "logs" / "prewarm.log"
    if prewarm_flag == "0":
        assert not log.exists()
    else:
        lines = log.read_text().strip().splitlines()
        assert lines[-1].startswith("prewarm: stopped: "), lines
