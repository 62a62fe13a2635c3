"""DCP <-> HF conversion end to end: a checkpoint written by 2 ranks, train.sh's end-of-run export, sharded and
bf16 exports, the HF -> DCP -> HF round trip, training on from a converted model, and bad input."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flame.checkpoint.dcp_io import is_model_only, load_model_tensors, read_metadata
from flame.checkpoint.layout import list_steps
from flame.cli import convert_dcp_to_hf, convert_hf_to_dcp
from flame.models import build_model, get_model_spec
from tests.checkpoint.helpers import output, train_sh
from tests.utils.helpers import save_checkpoint, tiny_model, tokens

pytestmark = pytest.mark.slow

SOFTPICK = {"model_type": "transformer", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "attn_impl": "parallel_softpick_attn"}  # fmt: skip
RUN = ["--training.steps", "2", "--training.seq_len", "64", "--training.batch_size", "2",
       "--lr_scheduler.warmup_steps", "1", "--checkpoint.interval", "100"]  # fmt: skip


def flame_model_from_checkpoint(step_path: Path, config: dict):
    args, _ = get_model_spec(config["model_type"]).args_cls.from_dict(config)
    model = build_model(args).eval()
    state = model.state_dict()
    load_model_tensors(step_path, state)
    return model


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A softpick transformer trained 2 steps on 2 ranks (FSDP: each rank wrote its shards) with train.sh, whose
    last checkpoint is the model alone in bf16 (torchtitan's model-only export), which train.sh then exported into
    the dump folder."""
    folder = tmp_path_factory.mktemp("trained")
    config = folder / "softpick.json"
    config.write_text(json.dumps(SOFTPICK))
    dump = folder / "run"
    result = train_sh(dump, *RUN, "--model.config", str(config), "--checkpoint.last_save_model_only",
                      "--checkpoint.export_dtype", "bfloat16")  # fmt: skip
    assert result.returncode == 0, output(result, dump)
    return dump


def test_train_sh_exports_final_checkpoint_of_two_ranks(trained):
    step = trained / "checkpoint" / "step-2"
    assert sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    metadata = read_metadata(step)
    assert is_model_only(metadata)
    assert {entry.properties.dtype for entry in metadata.state_dict_metadata.values()} == {torch.bfloat16}
    config = json.loads((trained / "config.json").read_text())
    # Softpick is not FLA's transformer: flame's own model type, which transformers refuses without flame.
    assert config["model_type"] == "flame_transformer" and config["attn_impl"] == "parallel_softpick_attn"
    assert config["dtype"] == "float32"
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (trained / name).is_file(), name
    x = tokens()
    expected = flame_model_from_checkpoint(step, SOFTPICK)(x)
    assert torch.equal(hf_model(trained)(x).logits, expected)
    # Rank 0 exported, once the run had finished; rank 1 did not.
    (rank0,) = (trained / "logs").glob("*/attempt_0/0/stdout.log")
    (rank1,) = (trained / "logs").glob("*/attempt_0/1/stdout.log")
    assert f"Converted {step} to {trained} (flame_transformer, float32)" in rank0.read_text()
    assert "Converted" not in rank1.read_text()


def test_sharded_bf16_export(trained, tmp_path):
    out = tmp_path / "hf"
    assert convert_dcp_to_hf.main(["--path", str(trained), "--step", "2", "--output", str(out),
                                   "--dtype", "bfloat16", "--max_shard_size", "300KB"]) == 0  # fmt: skip
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    weights = {k: v for shard in shards for k, v in load_file(out / shard).items()}
    assert set(weights) == set(index["weight_map"])
    fp32 = load_file(trained / "model.safetensors")
    assert all(
        weights[k].dtype == torch.bfloat16 and torch.equal(weights[k], fp32[k].bfloat16()) for k in fp32
    )
    assert hf_model(out).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_dcp_hf_round_trip_is_bitwise(trained, tmp_path, dtype):
    first = tmp_path / "first"
    assert convert_dcp_to_hf.main(["--path", str(trained), "--output", str(first), "--dtype", dtype,
                                   "--max_shard_size", "1MB"]) == 0  # fmt: skip
    step0 = tmp_path / "dump" / "checkpoint" / "step-0"
    assert convert_hf_to_dcp.main(["--model", str(first), "--checkpoint", str(step0)]) == 0
    second = tmp_path / "second"
    assert convert_dcp_to_hf.main(["--path", str(tmp_path / "dump"), "--step", "0", "--output", str(second),
                                   "--dtype", dtype, "--max_shard_size", "1MB"]) == 0  # fmt: skip
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_training_continues_from_converted_model(trained, tmp_path):
    """HF -> DCP step-0 -> a run loads it and trains on; with a vanishing learning rate the weights it saves and
    exports at the end are the converted ones, bit for bit."""
    dump = tmp_path / "continued"
    step0 = dump / "checkpoint" / "step-0"
    assert convert_hf_to_dcp.main(["--model", str(trained), "--checkpoint", str(step0)]) == 0
    result = train_sh(dump, "--model.config", str(step0 / "model_config.json"), *RUN,
                      "--training.steps", "1", "--optimizer.lr", "1e-30", "--lr_scheduler.warmup_steps", "0",
                      ngpu=1)  # fmt: skip
    assert result.returncode == 0, output(result, dump)
    assert "step-0" in result.stdout and "Training starts at step 1" in result.stdout
    assert list_steps(dump / "checkpoint") == {0: True, 1: True}
    before, after = load_file(trained / "model.safetensors"), load_file(dump / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ---- bad input: one line, exit 2, nothing written ---------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    """A model-only checkpoint of a tiny GDN (run's tokenizer recorded), and an output folder with a sentinel."""
    save_checkpoint(tmp_path / "dump", tiny_model("gated_deltanet"), step=3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("sentinel")
    return tmp_path / "dump", out


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def write_config(tmp_path: Path, **overrides) -> str:
    config = {"model_type": "gated_deltanet", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2,
              "num_heads": 2, "head_dim": 16, **overrides}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def bad_export(capsys, out: Path, *argv: str) -> str:
    assert convert_dcp_to_hf.main([*argv, "--output", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert (out / "config.json").read_text() == "sentinel"
    return one_error_line(capsys)


def test_bad_input_to_convert_dcp_to_hf(small, tmp_path, capsys):
    dump, out = small
    path = ["--path", str(dump)]
    message = bad_export(capsys, out, *path, "--step", "7")
    assert "no checkpoint step-7" in message and "complete: 3" in message
    (dump / "checkpoint" / "step-9").mkdir()  # a save that never finished
    assert "step-9 is incomplete" in bad_export(capsys, out, *path, "--step", "9")
    # A config of another shape, and one of the same shapes that computes something else.
    assert "different model config" in bad_export(
        capsys, out, *path, "--config", write_config(tmp_path, head_dim=32)
    )
    message = bad_export(capsys, out, *path, "--config", write_config(tmp_path, allow_neg_eigval=True))
    assert "different model config" in message and "allow_neg_eigval: False -> True" in message
    assert "format llama is not available" in bad_export(capsys, out, *path, "--format", "llama")
    assert "cannot export" in bad_export(capsys, out, *path, "--format", "olmo_hybrid")
    # Unwritable output: an existing file, and a folder below a file.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for target in (blocker, blocker / "sub"):
        assert convert_dcp_to_hf.main([*path, "--output", str(target)]) == 2
        assert "not a folder" in one_error_line(capsys)
    assert blocker.read_text() == "x"


def test_tokenizer_of_another_vocabulary_is_refused(tmp_path, capsys):
    save_checkpoint(
        tmp_path / "dump", tiny_model("delta_net", vocab_size=64), step=3
    )  # run's tokenizer: 4096
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("sentinel")
    assert "4096 tokens but the model's vocab_size is 64" in bad_export(
        capsys, out, "--path", str(tmp_path / "dump")
    )
    save_checkpoint(tmp_path / "dump2", tiny_model("delta_net"), step=3, tokenizer=None)
    assert "records no tokenizer" in bad_export(capsys, out, "--path", str(tmp_path / "dump2"))


def test_bad_input_to_convert_hf_to_dcp(small, trained, tmp_path, capsys):
    existing = tmp_path / "dump" / "checkpoint" / "step-3"
    assert (
        convert_hf_to_dcp.main(["--model", str(trained), "--checkpoint", str(existing.parent / "step-5")])
        == 2
    )
    assert "name the checkpoint folder step-0" in one_error_line(capsys)
    (existing.parent / "step-0").mkdir()
    (existing.parent / "step-0" / "keep").write_text("x")
    assert (
        convert_hf_to_dcp.main(["--model", str(trained), "--checkpoint", str(existing.parent / "step-0")])
        == 2
    )
    assert "already exists" in one_error_line(capsys)
    assert os.listdir(existing.parent / "step-0") == ["keep"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(
        json.dumps({**json.loads((trained / "config.json").read_text()), "hidden_size": 32})
    )
    (broken / "model.safetensors").symlink_to(trained / "model.safetensors")
    assert (
        convert_hf_to_dcp.main(["--model", str(broken), "--checkpoint", str(tmp_path / "new" / "step-0")])
        == 2
    )
    assert "do not fit its config.json" in one_error_line(capsys)
    assert not (tmp_path / "new").exists()
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    assert (
        convert_hf_to_dcp.main(["--model", str(broken), "--checkpoint", str(tmp_path / "new" / "step-0")])
        == 2
    )
    assert "model_type 'no_such_model' is not supported" in one_error_line(capsys)


def test_upstream_module_paths_run_the_same_tools():
    import importlib
    import subprocess
    import sys

    for tool in ("convert_dcp_to_hf", "convert_hf_to_dcp", "generate", "preprocess"):
        assert (
            importlib.import_module(f"flame.utils.{tool}").main
            is importlib.import_module(f"flame.cli.{tool}").main
        )
    usage = subprocess.run(
        [sys.executable, "-m", "flame.utils.convert_dcp_to_hf", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--path" in usage.stdout


@pytest.mark.parametrize("steps", [(), (0,)], ids=["no checkpoint", "seed checkpoint only"])
def test_the_end_of_run_export_with_nothing_to_export_imports_no_torch(tmp_path, steps):
    """The converter's ``--after_training`` (what train.sh's end-of-run export does): where the run left no trained
    checkpoint it says so without importing torch, and exits 0."""
    import subprocess
    import sys

    for step in steps:
        (tmp_path / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").write_bytes(b"")
    script = (
        "import sys\n"
        "from flame.cli import convert_dcp_to_hf\n"
        f"code = convert_dcp_to_hf.main(['--path', {str(tmp_path)!r}, '--step', '-1', '--after_training'])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines() == [
        "No trained checkpoint to convert to HF (checkpointing off, or only a seed checkpoint)",
        "0 False",
    ]
