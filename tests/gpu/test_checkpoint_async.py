"""Asynchronous checkpoints on one GPU (train.sh with NGPU=1; tests/gpu is collected only where CUDA is): a run stopped after step 3 (its checkpoints at steps 2 and 3 written by
``--checkpoint.async_mode async`` or ``async_with_pinned_mem``) and resumed from step 3 gives the losses of a run
that never checkpointed, step for step.

The CPU tests (tests/checkpoint/test_resume.py) require bit-equal losses; here the tolerance is 1e-5 relative,
because CUDA kernels that accumulate with atomics may round differently from run to run. What a faulty resume
changes (the data position, the optimizer moments, the LR schedule, the RNG state) moves the loss far more.
"""

import pytest

from flame.checkpoint.layout import list_steps
from tests.checkpoint.helpers import output, train_sh
from tests.trainer_helpers import tensorboard_scalars

pytestmark = pytest.mark.slow

# The default tiny transformer on real prose, a learning rate that changes every step, a checkpoint every 2 steps.
JOB = ["--training.steps", "6", "--training.seq_len", "64", "--training.batch_size", "2",
       "--training.num_workers", "2", "--training.seed", "7", "--lr_scheduler.warmup_steps", "2",
       "--checkpoint.interval", "2"]  # fmt: skip
RTOL = 1e-5


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """Losses of the 6-step job run without checkpoints."""
    dump = tmp_path_factory.mktemp("uninterrupted")
    result = train_sh(dump, *JOB, "--checkpoint.no-enable", ngpu=1, export_hf=False)
    assert result.returncode == 0, output(result, dump)
    losses = tensorboard_scalars(dump, "loss/train")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return losses


def assert_same_losses(
    got: dict[int, float], expected: dict[int, float], steps: list[int], what: str
) -> None:
    assert sorted(got) == steps, (what, got)
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=RTOL, abs=0), (what, step, got, expected)


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_checkpoint_resumes_the_uninterrupted_run(tmp_path, uninterrupted, mode):
    dump = tmp_path / "run"
    job = [*JOB, "--checkpoint.async_mode", mode]
    stopped = train_sh(dump, *job, "--training.stop_at_step", "3", ngpu=1, export_hf=False)
    assert stopped.returncode == 0, output(stopped, dump)
    assert list_steps(dump / "checkpoint") == {2: True, 3: True}
    # Saves in flight do not disturb training.
    assert_same_losses(tensorboard_scalars(dump, "loss/train"), uninterrupted, [1, 2, 3], f"{mode}: stopped")

    resumed = train_sh(dump, *job, "--metrics.save_tb_folder", "tb_resumed", ngpu=1, export_hf=False)
    assert resumed.returncode == 0, output(resumed, dump)
    log = resumed.stdout + resumed.stderr
    assert "step-3" in log and "Training starts at step 4" in log, output(resumed, dump)
    resumed_losses = tensorboard_scalars(dump, "loss/train", folder="tb_resumed")
    assert_same_losses(resumed_losses, uninterrupted, [4, 5, 6], f"{mode}: resumed")
    assert list_steps(dump / "checkpoint") == {4: True, 6: True}  # keep_latest_k 2, async saves complete
