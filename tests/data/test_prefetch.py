"""The device prefetcher: the loader's batches in the loader's order, and a checkpoint state that counts only the
batches handed out (the prefetched ones are read again after a resume)."""

import pickle

import pytest

from flame.data import DataConfigError, build_dataloader
from flame.data.loader import loader_options
from flame.data.prefetch import DevicePrefetcher
from tests.data.helpers import assert_same_batches, job_config, take


def handed_out(prefetcher: DevicePrefetcher, count: int) -> list:
    """``count`` batches the way the trainer takes them: one at a time, a prefetch after each."""
    batches = []
    for _ in range(count):
        batches.append(next(prefetcher))
        prefetcher.prefetch()
    return batches


@pytest.mark.parametrize("num_workers, ahead", [(0, 2), (2, 3)])
def test_prefetched_batches_and_resume_match_the_plain_loader(tokenizer, num_workers, ahead):
    config = job_config("--training.dataloader.num_workers", str(num_workers), seq_len=40, batch_size=2)
    uninterrupted = take(build_dataloader(config, tokenizer, 1, 2), 9)

    prefetcher = DevicePrefetcher(build_dataloader(config, tokenizer, 1, 2), device=None, ahead=ahead)
    iter(prefetcher)
    first = handed_out(prefetcher, 4)
    assert len(prefetcher._held) == ahead  # batches 5.. were read from the loader, not handed out
    assert_same_batches(uninterrupted[:4], first)
    checkpoint = pickle.loads(pickle.dumps(prefetcher.state_dict()))

    resumed = DevicePrefetcher(build_dataloader(config, tokenizer, 1, 2), device=None, ahead=ahead)
    resumed.load_state_dict(checkpoint)
    iter(resumed)
    assert_same_batches(uninterrupted[4:], handed_out(resumed, 5))
    assert prefetcher.wait_seconds > 0


def test_state_before_the_first_batch_is_the_start(tokenizer):
    config = job_config(seq_len=40, batch_size=2)
    prefetcher = DevicePrefetcher(build_dataloader(config, tokenizer), device=None, ahead=2)
    iter(prefetcher)
    prefetcher.prefetch()  # two batches read ahead, none handed out
    state = prefetcher.state_dict()
    resumed = DevicePrefetcher(build_dataloader(config, tokenizer), device=None, ahead=2)
    resumed.load_state_dict(state)
    iter(resumed)
    assert_same_batches(take(build_dataloader(config, tokenizer), 3), handed_out(resumed, 3))


def test_resuming_takes_the_checkpoints_workers_unless_they_were_given(tokenizer):
    one_worker = job_config("--training.num_workers", "1", seq_len=40, batch_size=2)
    uninterrupted = take(build_dataloader(one_worker, tokenizer), 6)
    saved = build_dataloader(one_worker, tokenizer)
    take(saved, 2)
    checkpoint = saved.state_dict()
    given = build_dataloader(job_config("--training.num_workers", "0", seq_len=40, batch_size=2), tokenizer)
    with pytest.raises(DataConfigError, match="written with training.num_workers 1, this run has 0: resume with "
                       "--training.num_workers 1"):  # fmt: skip
        given.load_state_dict(checkpoint)
    chosen = build_dataloader(job_config(seq_len=40, batch_size=2), tokenizer)  # 0 workers chosen on the CPU
    assert chosen.num_workers == 0
    chosen.load_state_dict(checkpoint)
    assert chosen.num_workers == 1
    assert_same_batches(uninterrupted[2:], take(chosen, 4))


def test_unset_workers_and_pinning_are_chosen_for_the_device(monkeypatch):
    options = job_config().training.dataloader
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert loader_options(options, "cuda")["num_workers"] == 4
    assert loader_options(options, "cuda")["pin_memory"] is True
    assert loader_options(options, "cpu")["num_workers"] == 0
    assert loader_options(options, "cpu")["pin_memory"] is False
    monkeypatch.setenv(
        "LOCAL_WORLD_SIZE", "8"
    )  # 2 CPUs per rank: one worker, one core for the training process
    assert loader_options(options, "cuda")["num_workers"] == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert loader_options(options, "cuda")["num_workers"] == 1
    given = job_config(
        "--training.num_workers", "0", "--training.dataloader.no-pin-memory"
    ).training.dataloader
    assert (
        loader_options(given, "cuda")["num_workers"] == 0 and not loader_options(given, "cuda")["pin_memory"]
    )
