"""flame.ops.autotune: processes that meet an untuned kernel together tune it once and all run that choice.

Triton caches autotuning results only on a GPU (not under the interpreter), so the lock is tested around a
stand-in with Triton's behaviour: read the key's result from the cache directory, else benchmark and write it."""

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path
from types import SimpleNamespace

from flame.ops import autotune

BENCH_S = 0.3


def tuner(name: str = "kernel-a"):
    # A JIT function (it has the cache key) inside a heuristics wrapper, as FLA's kernels are.
    return SimpleNamespace(fn=SimpleNamespace(fn=SimpleNamespace(cache_key=name)))


CONFIGS = [SimpleNamespace(pre_hook=None, block=16), SimpleNamespace(pre_hook=None, block=32)]


def make_check_disk_cache(cache: Path, record: list):
    """Triton's Autotuner.check_disk_cache in miniature: True if the result was read from the cache."""

    def check_disk_cache(tuner, tuning_key, configs, bench_fn):
        path = cache / f"{tuner.fn.fn.cache_key}-{tuning_key}.json"
        if path.exists():
            record.append(("read", json.loads(path.read_text())["choice"]))
            return True
        bench_fn()
        path.write_text(json.dumps({"choice": record[-1][1]}))
        return False

    return check_disk_cache


def race(cache: Path, serialized: bool, start, results) -> None:
    """One process: wait for the others, then meet the untuned kernel."""
    record = []
    check = make_check_disk_cache(cache, record)
    if serialized:
        check = autotune.locked(check, cache / "locks")

    def bench():
        began = time.monotonic()
        time.sleep(BENCH_S)
        record.append(("benchmarked", os.getpid(), began, time.monotonic()))

    start.wait()
    check(tuner(), (2048, 128), CONFIGS, bench)
    results.put(record[-1])


def run_race(cache: Path, serialized: bool, processes: int = 4) -> list[tuple]:
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=race, args=(cache, serialized, start, results)) for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    return outcomes


def test_without_the_lock_every_process_benchmarks_and_keeps_its_own_choice(tmp_path):
    outcomes = run_race(tmp_path, serialized=False)
    assert [kind for kind, *_ in outcomes].count("benchmarked") > 1
    assert len({outcome[1] for outcome in outcomes}) > 1


def test_with_the_lock_one_process_benchmarks_and_every_process_runs_its_choice(tmp_path):
    outcomes = run_race(tmp_path, serialized=True)
    benchmarked = [outcome for outcome in outcomes if outcome[0] == "benchmarked"]
    assert len(benchmarked) == 1
    choice = benchmarked[0][1]
    assert all(outcome == ("read", choice) for outcome in outcomes if outcome[0] == "read")


def test_other_keys_and_kernels_do_not_wait(tmp_path):
    record = []
    check = autotune.locked(make_check_disk_cache(tmp_path, record), tmp_path / "locks")
    identity = "-".join(["kernel-a", str((2048, 128)), *map(str, CONFIGS)])
    held = tmp_path / "locks" / (autotune.hashlib.sha256(identity.encode()).hexdigest() + ".lock")
    with autotune.host_lock(held):  # another process tuning kernel-a at (2048, 128)
        began = time.monotonic()
        check(tuner(), (4096, 128), CONFIGS, lambda: record.append(("benchmarked", 1)))
        check(tuner("kernel-b"), (2048, 128), CONFIGS, lambda: record.append(("benchmarked", 2)))
        assert time.monotonic() - began < 1.0
    assert record == [("benchmarked", 1), ("benchmarked", 2)]


def test_a_wait_past_the_limit_tunes_here_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(autotune, "WAIT_S", 0.3)
    path = tmp_path / "locks" / "k.lock"
    context = multiprocessing.get_context("fork")
    holding, release = context.Event(), context.Event()

    def hold():
        with autotune.host_lock(path):
            holding.set()
            release.wait(30)

    holder = context.Process(target=hold)
    holder.start()
    try:
        assert holding.wait(30)
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=autotune.__name__), autotune.host_lock(path):
            waited = time.monotonic() - began
    finally:
        release.set()
        holder.join(30)
    assert 0.3 <= waited < 2.0
    assert [r.getMessage() for r in caplog.records if "tuning it here too" in r.getMessage()] != []


def test_configurations_with_pre_hooks_are_not_locked(tmp_path):
    """Triton keeps no result on disk for them, so a lock would only make the processes wait in turn."""
    called = []
    configs = [SimpleNamespace(pre_hook=print, block=16)]
    check = autotune.locked(lambda *args: called.append(args) or False, tmp_path / "locks")
    check(tuner(), (2048,), configs, lambda: None)
    assert len(called) == 1 and not (tmp_path / "locks").exists()


def test_installed_on_tritons_autotuner_once(monkeypatch, tmp_path):
    from triton.runtime import autotuner  # dev dependency: installed wherever the tests run

    monkeypatch.setattr(autotuner.Autotuner, "check_disk_cache", autotuner.Autotuner.check_disk_cache)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    original = autotuner.Autotuner.check_disk_cache
    assert autotune.tune_once_per_host()
    wrapped = autotuner.Autotuner.check_disk_cache
    assert wrapped is not original and wrapped.__wrapped__ is original
    assert autotune.tune_once_per_host() and autotuner.Autotuner.check_disk_cache is wrapped


def test_one_cache_folder_for_every_device(monkeypatch, tmp_path):
    """torch.compile would give an unset TRITON_CACHE_DIR a folder per GPU, so rank 1 would not read what rank 0
    tuned; once flame has run, every device's folder is Triton's default and the locks live there."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    from triton.runtime import autotuner

    monkeypatch.setattr(autotuner.Autotuner, "check_disk_cache", autotuner.Autotuner.check_disk_cache)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "restored after the test")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert triton_cache_dir(1) != triton_cache_dir(0)
    assert autotune.tune_once_per_host()
    host_cache = str(tmp_path / ".triton" / "cache")
    assert triton_cache_dir(0) == triton_cache_dir(1) == os.environ["TRITON_CACHE_DIR"] == host_cache
    assert autotune.lock_dir() == Path(host_cache) / autotune.LOCK_DIR


def test_a_chosen_cache_folder_is_kept(monkeypatch, tmp_path):
    from triton.runtime import autotuner

    monkeypatch.setattr(autotuner.Autotuner, "check_disk_cache", autotuner.Autotuner.check_disk_cache)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert autotune.tune_once_per_host()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert autotune.lock_dir() == tmp_path / "mine" / autotune.LOCK_DIR
