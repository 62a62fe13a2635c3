"""The default job end to end through train.sh: one process, and two processes with FSDP, pipeline or context
parallelism (on packed documents), over gloo."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.trainer_helpers import tensorboard_scalars, text_events

REPO = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"step\s+(\d+)/\d+\s+loss\s+([0-9.]+)")
# The harness's tolerances (tests/parallelize): float32 summation order moves gradient norms more.
GRADIENT_TOLERANCES = {"loss/train": 1e-5, "grad_norm": 1e-4}


def run_train_sh(dump: Path, ngpu: int, *args: str) -> dict[int, float]:
    """Run train.sh (without its end-of-run HF export: tests/cli/test_convert.py covers it); return {step: loss}
    from the console."""
    result = subprocess.run(
        ["bash", str(REPO / "train.sh"), "--job.dump_folder", str(dump), "--metrics.log_freq", "1", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "NGPU": str(ngpu),
            "FLAME_EXPORT_HF": "0",
        },
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {int(step): float(loss) for step, loss in LOSS.findall(result.stdout)}


def train_from_one_seed(tmp_path: Path, common: list[str], runs: dict[str, tuple[int, list[str]]]) -> None:
    """A seed checkpoint, then each run (processes, its own flags) from a copy of it, so all start equal."""
    run_train_sh(tmp_path / "seed", 1, *common, "--checkpoint.create_seed_checkpoint")
    for run, (ngpu, flags) in runs.items():
        shutil.copytree(tmp_path / "seed" / "checkpoint", tmp_path / run / "checkpoint")
        run_train_sh(tmp_path / run, ngpu, *common, *flags)


def assert_runs_match_run_one(tmp_path: Path, runs: list[str], tolerances: dict[str, float], min_drop: float):
    """Each run's logged scalars equal run "one"'s at steps 1-3 within the relative tolerance, and run one's loss
    falls by at least ``min_drop`` (the steps do train)."""
    for name, rtol in tolerances.items():
        single = tensorboard_scalars(tmp_path / "one", name)
        assert sorted(single) == [1, 2, 3], name
        for run in runs:
            split = tensorboard_scalars(tmp_path / run, name)
            assert sorted(split) == [1, 2, 3], (run, name)
            for step in (1, 2, 3):
                assert split[step] == pytest.approx(single[step], rel=rtol), (run, name, step, single, split)
    loss = tensorboard_scalars(tmp_path / "one", "loss/train")
    assert loss[3] < loss[1] - min_drop


@pytest.fixture(scope="module")
def periodic_corpus(tmp_path_factory):
    """Identical documents of exactly seq_len tokens (with BOS/EOS): every packed row is the same sequence, so
    one process with batch 4 and two processes with batch 2 each see the same global batch."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "flame/assets/tokenizer")
    text = (
        "Return a new sorted list from the items in iterable. A custom key function can be supplied to customize "
        "the sort order, and the reverse flag can be set to request the result in descending order."
    )
    seq_len = len(tokenizer.encode(text)) + 2
    folder = tmp_path_factory.mktemp("periodic")
    for split, count in (("train", 64), ("validation", 8)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for _ in range(count):
                f.write(json.dumps({"text": text}) + "\n")
    return folder, seq_len


@pytest.mark.slow
def test_default_job_trains_and_writes_checkpoint_and_tensorboard(tmp_path):
    dump = tmp_path / "run"
    losses = run_train_sh(dump, 1, "--training.steps", "12", "--lr_scheduler.warmup_steps", "2",
                          "--checkpoint.interval", "6")  # fmt: skip
    assert sorted(losses) == list(range(1, 13))
    assert losses[1] > 8.0  # ~ln(4096) at initialisation
    assert losses[12] < losses[1] - 0.8  # clearly falling
    assert (dump / "checkpoint" / "step-6").is_dir() and (dump / "checkpoint" / "step-12").is_dir()
    assert len({p.parent for p in (dump / "tb").rglob("events.out.tfevents.*")}) == 1  # one run, one log
    logged = tensorboard_scalars(dump, "loss/train")
    assert sorted(logged) == list(range(1, 13))
    assert logged[12] == pytest.approx(losses[12], abs=1e-4)  # the console shows 4 decimals
    assert (dump / "logs").is_dir()


@pytest.mark.slow
def test_fsdp_and_pipeline_on_two_processes_match_one_process(tmp_path, periodic_corpus):
    folder, seq_len = periodic_corpus
    common = ["--training.dataset", str(folder), "--training.seq_len", str(seq_len), "--training.steps", "3",
              "--lr_scheduler.warmup_steps", "1", "--checkpoint.interval", "100", "--training.seed", "7"]  # fmt: skip
    # Validation and text samples run on every rank of a sharded model (only rank 0 logs).
    extras = ["--validation.enable", "--validation.freq", "2", "--inference.interval", "2",
              "--inference.max_new_tokens", "4"]  # fmt: skip
    # Two pipeline stages of the tiny model's 4 layers, 4 micro-batches of 1 row each: the same global batch.
    pipelined = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.pipeline_parallel_microbatch_size", "1", "--training.batch_size", "4"]  # fmt: skip
    # Every run starts from the same seed checkpoint (step 0, model only), resharded by DCP on load (into each
    # rank's pipeline stage for the pipelined run). Same weights, same global batch: only float32 summation order
    # differs between 1 and 2 ranks.
    runs = {
        "one": (1, [*extras, "--training.batch_size", "4"]),
        "two": (2, [*extras, "--training.batch_size", "2"]),
        "pipelined": (2, pipelined),
    }
    train_from_one_seed(tmp_path, common, runs)
    assert_runs_match_run_one(tmp_path, ["two", "pipelined"], {"loss/train": 1e-5}, min_drop=0.1)
    # Every row of the validation split is the same sequence: same loss whichever rank reads it.
    single_validation = tensorboard_scalars(tmp_path / "one", "loss/validation")
    sharded_validation = tensorboard_scalars(tmp_path / "two", "loss/validation")
    assert sorted(single_validation) == sorted(sharded_validation) == [2, 3]
    for step in (2, 3):
        assert sharded_validation[step] == pytest.approx(single_validation[step], rel=1e-5)
    assert sorted(text_events(tmp_path / "two", "samples/0")) == [2]


@pytest.mark.slow
def test_packed_documents_with_context_parallelism_match_one_process(tmp_path):
    """Two ranks through train.sh: training.varlen (the loader's packed rows and their cu_seqlens) with cp 2 on a
    4-layer GatedDeltaNet / attention hybrid, against one process, both from one seed checkpoint. The trainer
    slices each row for the cp ranks, the GatedDeltaNet layers relay the states of documents that cross the slice
    border, and the attention layers gather the other half's keys. (Every parallelism with packed rows, pipeline x
    cp included, on the shared training step: tests/parallelize/test_parallel_training.py.)"""
    config = tmp_path / "hybrid.json"
    config.write_text(
        '{"model_type": "gated_deltanet", "hidden_size": 128, "num_hidden_layers": 4, "num_heads": 2,'
        ' "head_dim": 32, "attn": {"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2}, "vocab_size": 4096}'
    )
    common = ["--model.config", str(config), "--training.seq_len", "128", "--training.batch_size", "1",
              "--training.varlen", "--training.steps", "3", "--lr_scheduler.warmup_steps", "1",
              "--checkpoint.interval", "100", "--training.seed", "7"]  # fmt: skip
    train_from_one_seed(
        tmp_path, common, {"one": (1, []), "cp2": (2, ["--parallelism.context_parallel_degree", "2"])}
    )
    assert_runs_match_run_one(tmp_path, ["cp2"], GRADIENT_TOLERANCES, min_drop=0.05)
