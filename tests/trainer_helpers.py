"""Driving flame's Trainer in-process (one CPU rank, gloo) on the tiny default model with short sequences, and
train.sh's pre-flight dry run in-process."""

from pathlib import Path

import pytest
import torch

from flame.launch import free_port  # noqa: F401  (the tests' rendezvous ports)

TINY = ["--training.seq_len", "64", "--training.batch_size", "2", "--training.steps", "4",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--checkpoint.no-enable",
        "--training.seed", "7"]  # fmt: skip


def dry_run_output(capsys, *flags: str) -> str:
    """What train.sh's pre-flight dry run prints (the merged job, ``params:``, ``flops_per_token:``), run in this
    process."""
    from flame.launch import EXIT_DONE, preflight

    capsys.readouterr()
    assert preflight([*flags, "--job.dry_run"]) == EXIT_DONE
    return capsys.readouterr().out


@pytest.fixture
def make_trainer(tmp_path, monkeypatch):
    """make_trainer(*flags, dump=...) -> a Trainer of the tiny job (flags override TINY); all closed at the end."""
    from flame import compat
    from flame.config import parse_args
    from flame.train import Trainer

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    compat.apply()
    trainers = []

    def make(*flags: str, dump: Path | None = None):
        dump = dump or tmp_path / f"run{len(trainers)}"
        trainer = Trainer(parse_args(["--job.dump_folder", str(dump), *TINY, *flags]))
        trainers.append(trainer)
        return trainer

    yield make
    for trainer in trainers:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch.use_deterministic_algorithms(False)
    torch.autograd.set_detect_anomaly(False)


def tensorboard_scalars(dump: Path, tag: str, folder: str = "tb") -> dict[int, float]:
    """{step: value} of one scalar over every event file under <dump>/<folder>, read with TensorBoard's reader
    (float32, as TensorBoard stores it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in sorted({p.parent for p in (dump / folder).rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values.update({event.step: event.value for event in accumulator.Scalars(tag)})
    return values


def text_events(dump: Path, tag: str) -> dict[int, str]:
    """{step: text} of one text summary (add_text) under <dump>/tb."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = {p.parent for p in (dump / "tb").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    accumulator.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in accumulator.Tensors(f"{tag}/text_summary")}


class GivenBatches:
    """Micro-batches given by a test, in place of the trainer's prefetcher."""

    def __init__(self, batches: list):
        self._batches = iter(batches)

    def __next__(self):
        return next(self._batches)

    def prefetch(self) -> None:
        pass
