"""flame.ops.autotune: processes that meet an untuned kernel together tune it once and all run that choice.

Triton caches autotuning results only on a GPU (not under the interpreter), so the lock is tested around a
stand-in with Triton's behaviour: read the key's result from the cache directory, else benchmark and write it.
FLA's kernels kept to their first config are tested on real autotuners (building one needs no GPU)."""

import json
import logging
import multiprocessing
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import triton
import triton.language as tl

from flame.ops import autotune

BENCH_S = 0.3


def tuner(name: str = "kernel-a"):
    # A JIT function (it has the cache key) inside a heuristics wrapper, as FLA's kernels are; base_fn names it.
    return SimpleNamespace(
        fn=SimpleNamespace(fn=SimpleNamespace(cache_key=name)), base_fn=SimpleNamespace(__name__=name)
    )


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


def test_other_keys_and_kernels_do_not_wait(tmp_path, monkeypatch, caplog):
    """A wait on the held lock would end in the give-up warning; none comes."""
    monkeypatch.setattr(autotune, "WAIT_S", 0.5)
    record = []
    check = autotune.locked(make_check_disk_cache(tmp_path, record), tmp_path / "locks")
    identity = "-".join(["kernel-a", str((2048, 128)), *map(str, CONFIGS)])
    held = tmp_path / "locks" / (autotune.hashlib.sha256(identity.encode()).hexdigest() + ".lock")
    with caplog.at_level(logging.WARNING, logger=autotune.__name__), autotune.host_lock(held):
        # another process tuning kernel-a at (2048, 128)
        check(tuner(), (4096, 128), CONFIGS, lambda: record.append(("benchmarked", 1)))
        check(tuner("kernel-b"), (2048, 128), CONFIGS, lambda: record.append(("benchmarked", 2)))
    assert record == [("benchmarked", 1), ("benchmarked", 2)]
    assert "tuning it here too" not in caplog.text


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
    assert 0.3 <= waited < 30  # given up at WAIT_S, not when the holder let go (30 s)
    assert [r.getMessage() for r in caplog.records if "tuning it here too" in r.getMessage()] != []


def test_a_kernel_tuned_here_is_logged_once_and_one_read_from_the_cache_is_not(tmp_path, caplog):
    record = []
    check = autotune.locked(make_check_disk_cache(tmp_path, record), tmp_path / "locks")

    def bench(choice):
        time.sleep(0.2)
        record.append(("benchmarked", choice))

    with caplog.at_level(logging.INFO, logger=autotune.__name__):
        check(tuner(), (2048, 128), CONFIGS, lambda: bench(7))
        check(tuner(), (2048, 128), CONFIGS, lambda: bench(8))
        check(
            tuner(), (4096, 128), CONFIGS[:1], lambda: bench(9)
        )  # one setting: compiled and timed, no choice
    assert record == [("benchmarked", 7), ("read", 7), ("benchmarked", 9)]
    lines = [r.getMessage() for r in caplog.records if "tuned Triton kernel" in r.getMessage()]
    assert len(lines) == 1
    assert re.match(
        r"tuned Triton kernel kernel-a over 2 settings in 0\.[2-9] s: .* key \(2048, 128\)$", lines[0]
    )


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
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    original = autotuner.Autotuner.check_disk_cache
    assert autotune.tune_once_per_host()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"  # results kept in the cache, as train.sh keeps them
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
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    assert triton_cache_dir(1) != triton_cache_dir(0)
    assert autotune.tune_once_per_host()
    host_cache = str(tmp_path / ".triton" / "cache")
    assert triton_cache_dir(0) == triton_cache_dir(1) == os.environ["TRITON_CACHE_DIR"] == host_cache
    assert autotune.lock_dir() == Path(host_cache) / autotune.LOCK_DIR


def test_a_chosen_cache_folder_is_kept(monkeypatch, tmp_path):
    from triton.runtime import autotuner

    monkeypatch.setattr(autotuner.Autotuner, "check_disk_cache", autotuner.Autotuner.check_disk_cache)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    assert autotune.tune_once_per_host()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"  # the user's choice stands
    assert autotune.lock_dir() == tmp_path / "mine" / autotune.LOCK_DIR


# Triton's base32 key folder, or flame's record of one of its kernels by its code / the kernel's file
SHIPPED_NAME = re.compile(r"^([A-Z2-7]{52}|flame-[0-9a-f]{48})/\w+\.autotune\.json$")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Triton's check_disk_cache runnable on a CPU: a fixed compiler target and backend hash (the rest of
    Triton's cache key, its own version and the kernel's source, is the real one)."""
    import triton.compiler.compiler
    from triton.runtime import autotuner

    monkeypatch.setattr(
        autotuner, "driver", SimpleNamespace(active=SimpleNamespace(get_current_target=lambda: "t"))
    )
    monkeypatch.setattr(
        triton.compiler.compiler, "make_backend", lambda target: SimpleNamespace(hash=lambda: "b")
    )


def a_tuned_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x, n, BLOCK: tl.constexpr):
        pass

    configs = [triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=8)]
    return triton.autotune(configs=configs, key=["n"], cache_results=True)(scale), configs


def test_a_bundle_made_from_a_tuned_cache_is_what_a_fresh_cache_runs(fake_gpu, monkeypatch, tmp_path):
    """Tuned on one machine (cache A), bundled, seeded into a fresh machine's cache (B): Triton reads the choice
    there without benchmarking."""
    import triton

    tuner, configs = a_tuned_kernel()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a"))

    def bench():
        tuner.configs_timings = {configs[0]: [2.0], configs[1]: [1.0]}

    assert tuner.check_disk_cache((1024,), configs, bench) is False  # tuned and written
    assets = tmp_path / "assets"
    bundle = autotune.bundle_path("NVIDIA H100 80GB HBM3", assets)
    assert bundle.name == "nvidia-h100-80gb-hbm3.json"
    results = autotune.collect_results(tmp_path / "a")
    assert len(results) == 1 and SHIPPED_NAME.match(next(iter(results)))
    assert autotune.write_bundle(bundle, "NVIDIA H100 80GB HBM3", triton.__version__, results) == 1

    fresh = tmp_path / "b"
    seed = autotune.seed_shipped_results
    assert seed("NVIDIA A100-SXM4-80GB", triton.__version__, fresh, assets) == 0  # no bundle for its chip
    assert seed("NVIDIA H100 80GB HBM3", "0.0.1", fresh, assets) == 0  # tuned with another Triton
    assert seed("NVIDIA H100 80GB HBM3", triton.__version__, fresh, assets) == 1
    assert seed("NVIDIA H100 80GB HBM3", triton.__version__, fresh, assets) == 0  # what is there stays
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    tuner.cache.clear()
    assert tuner.check_disk_cache((1024,), configs, lambda: pytest.fail("benchmarked")) is True
    assert tuner.cache[(1024,)].kwargs == {"BLOCK": 32} and tuner.cache[(1024,)].num_warps == 8
    # Another shape is not in the bundle: it tunes as before.
    assert tuner.check_disk_cache((4096,), configs, bench) is False


KERNEL_FILE = """
import triton
import triton.language as tl

SCALE = tl.constexpr({scale})
{blank_lines}

@triton.jit
def helper(x):
    return x * SCALE{helper_change}


@triton.jit
def scale(x, n, BLOCK: tl.constexpr):
    # a comment{comment}
    helper(x)
"""


def flame_kernel(tmp_path: Path, name: str, blank_lines=0, helper_change="", scale=2, comment=""):
    """One of flame's autotuned kernels loaded from a file of its own: the same code can sit at other lines."""
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(
        KERNEL_FILE.format(
            blank_lines="\n" * blank_lines, helper_change=helper_change, scale=scale, comment=comment
        )
    )
    spec = importlib.util.spec_from_file_location("flame.ops.moving_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    configs = [triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=8)]
    return triton.autotune(configs=configs, key=["n"], cache_results=True)(module.scale), configs


def test_a_flame_kernel_that_moved_in_its_file_runs_its_shipped_choice(fake_gpu, monkeypatch, tmp_path):
    """Triton's key of a kernel holds the line it starts on: moved by an edit above it, the kernel misses its
    shipped result. flame's record by its code serves it without a benchmark, and Triton files it anew."""
    from triton.runtime.autotuner import Autotuner

    wrapped = autotune.locked(Autotuner.check_disk_cache, tmp_path / "locks")
    tuned, configs = flame_kernel(tmp_path, "v1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a"))

    def bench(tuner):
        def run():
            tuner.configs_timings = {configs[0]: [2.0], configs[1]: [1.0]}

        return run

    assert wrapped(tuned, (1024,), configs, bench(tuned)) is False
    results = autotune.collect_results(tmp_path / "a")
    folders = sorted(name.split("/")[0] for name in results)
    assert len(folders) == 2 and [folder.startswith("flame-") for folder in folders] == [False, True]
    assert all(map(SHIPPED_NAME.match, results))  # Triton's entry and flame's record
    bundle = autotune.bundle_path("GPU", tmp_path / "assets")
    autotune.write_bundle(bundle, "GPU", triton.__version__, results)

    def fresh_machine(name: str) -> None:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / name))
        assert (
            autotune.seed_shipped_results("GPU", triton.__version__, tmp_path / name, tmp_path / "assets")
            == 2
        )

    moved, configs = flame_kernel(tmp_path, "v2", blank_lines=5, comment=" that changed")
    assert autotune.kernel_identity(moved) != autotune.kernel_identity(tuned)
    fresh_machine("b")
    assert Autotuner.check_disk_cache(moved, (1024,), configs, bench(moved)) is False  # Triton alone: tunes
    fresh_machine("c")
    no_bench = lambda: pytest.fail("benchmarked")  # noqa: E731
    assert wrapped(moved, (1024,), configs, no_bench) is False
    assert moved.cache[(1024,)].kwargs == {"BLOCK": 32} and moved.cache[(1024,)].num_warps == 8
    moved.cache.clear()
    assert wrapped(moved, (1024,), configs, no_bench) is True  # Triton filed it under the kernel's new key
    assert moved.cache[(1024,)].kwargs == {"BLOCK": 32}

    # Code that changed (the kernel's helper, a constant it reads) tunes again; so does another shape.
    for name, change in (("v3", {"helper_change": " + 1"}), ("v4", {"scale": 3})):
        changed, configs = flame_kernel(tmp_path, name, **change)
        fresh_machine(f"fresh-{name}")
        benched = []

        def counted(run=bench(changed), benched=benched):  # noqa: B008 (bound per loop turn)
            benched.append(1)
            run()

        assert wrapped(changed, (1024,), configs, counted) is False
        assert benched == [1], name
    assert wrapped(moved, (4096,), configs, bench(moved)) is False


def test_a_record_is_kept_only_for_flames_own_kernels(fake_gpu, monkeypatch, tmp_path):
    tuned, configs = a_tuned_kernel()  # a kernel of this test module, not flame's
    assert autotune.source_record(tuned, (1024,), configs) is None
    flame_tuned, configs = flame_kernel(tmp_path, "v1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    record = autotune.source_record(flame_tuned, (1024,), configs)
    assert record.parent.parent == tmp_path / "cache" and record.name == "scale.autotune.json"
    assert autotune.source_record(flame_tuned, (2048,), configs) != record


def test_a_gpu_without_its_own_result_takes_its_chips_sibling(tmp_path):
    """An H100 takes the H200 bundle's entries its own bundle lacks, and keeps its own where both have one; a GPU of
    another chip takes neither."""
    assets = tmp_path / "assets"
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    own = {"key": [1], "configs_timings": [[{"num_warps": 4}, [1.0]]]}
    sibling = {"key": [1], "configs_timings": [[{"num_warps": 8}, [1.0]]]}
    autotune.write_bundle(autotune.bundle_path(h100, assets), h100, "3.6.0", {"A/k.autotune.json": own})
    autotune.write_bundle(
        autotune.bundle_path(h200, assets), h200, "3.6.0",
        {"A/k.autotune.json": sibling, "B/k.autotune.json": sibling},
    )  # fmt: skip
    cache = tmp_path / "cache"
    assert autotune.seed_shipped_results(h100, "3.6.0", cache, assets) == 2
    assert json.loads((cache / "A" / "k.autotune.json").read_text()) == own
    assert json.loads((cache / "B" / "k.autotune.json").read_text()) == sibling
    assert autotune.seed_shipped_results("NVIDIA A100-SXM4-80GB", "3.6.0", tmp_path / "other", assets) == 0
    assert autotune.bundle_devices(h200) == [h200, h100]


def test_bundles_merge_and_a_new_triton_replaces_them(tmp_path):
    path = tmp_path / "gpu.json"
    entry = {"key": [1], "configs_timings": []}
    assert autotune.write_bundle(path, "GPU", "3.6.0", {"A/k.autotune.json": entry}) == 1
    assert autotune.write_bundle(path, "GPU", "3.6.0", {"B/k.autotune.json": entry}) == 2
    assert autotune.write_bundle(path, "GPU", "3.7.0", {"C/k.autotune.json": entry}) == 1
    assert list(json.loads(path.read_text())["results"]) == ["C/k.autotune.json"]
    with pytest.raises(ValueError, match="holds results of 'GPU'"):
        autotune.write_bundle(path, "Other GPU", "3.7.0", {})


def test_seeding_follows_whether_kernels_read_the_cache_and_flames_switch(monkeypatch, tmp_path):
    import triton

    assets = tmp_path / "assets"
    entry = {"key": [1], "configs_timings": []}
    autotune.write_bundle(
        autotune.bundle_path("GPU", assets), "GPU", triton.__version__, {"A/k.autotune.json": entry}
    )
    monkeypatch.setattr(autotune, "SHIPPED_DIR", assets)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setenv("FLA_CACHE_RESULTS", "0")
    assert autotune.use_shipped_results("GPU") == 0  # no kernel would read it
    monkeypatch.delenv("FLA_CACHE_RESULTS")
    assert autotune.use_shipped_results("GPU") == 1  # FLA's kernels read it (a launch without train.sh)
    (tmp_path / "cache" / "A" / "k.autotune.json").unlink()
    monkeypatch.setenv("FLA_CACHE_RESULTS", "0")
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    monkeypatch.setenv("FLAME_SHIPPED_TUNING", "0")
    assert autotune.use_shipped_results("GPU") == 0
    monkeypatch.delenv("FLAME_SHIPPED_TUNING")
    assert autotune.use_shipped_results("GPU") == 1
    assert json.loads((tmp_path / "cache" / "A" / "k.autotune.json").read_text()) == entry


def test_the_shipped_bundles_are_tritons_cache_entries():
    """Each shipped bundle sits where its GPU's name puts it and holds cache entries this Triton can read."""
    from triton.runtime.autotuner import Config

    bundles = sorted(autotune.SHIPPED_DIR.glob("*.json"))
    assert {path.name for path in bundles} >= {"nvidia-h100-80gb-hbm3.json", "nvidia-h200.json"}
    for path in bundles:
        bundle = json.loads(path.read_text())
        assert autotune.bundle_path(bundle["device"]) == path and bundle["triton"] == "3.6.0"
        for name, result in bundle["results"].items():
            assert SHIPPED_NAME.match(name), name
            assert result["configs_timings"] and isinstance(result["key"], list), name
            for config, timings in result["configs_timings"]:
                assert Config(**config).num_warps >= 1 and timings, name


def flames_tuning_keys() -> dict[str, list[list[str]]]:
    """The tuning key of each of flame's autotuned Triton kernels, by kernel name (two kernels share a name)."""
    import importlib
    import pkgutil

    from triton.runtime.autotuner import Autotuner

    import flame.ops

    keys = {}
    for module in pkgutil.walk_packages(flame.ops.__path__, "flame.ops."):
        for value in vars(importlib.import_module(module.name)).values():
            if isinstance(value, Autotuner):
                keys.setdefault(value.base_fn.__name__, []).append(list(value.keys))
    return keys


def test_the_shipped_entries_of_flames_kernels_have_the_keys_their_autotuners_make():
    """Triton files a result under the key's values, then its tensors' dtypes: an entry whose values are not the
    autotuner's key as the kernel is now (a key argument added or removed) is one no call makes, and the kernel
    tunes on a fresh machine. A kernel whose key changes has its entries dropped until a GPU tunes them again."""

    def is_dtype(value) -> bool:
        return isinstance(value, str) and value.startswith("torch.")

    def made_by(key: list, names: list[str]) -> bool:
        values, dtypes = key[: len(names)], key[len(names) :]
        return (
            len(values) == len(names)
            and not any(map(is_dtype, values))
            and dtypes
            and all(map(is_dtype, dtypes))
        )

    keys = flames_tuning_keys()
    assert {"_dhu_kernel", "_fwd_h_kernel", "_dqkwg_kernel"} <= set(keys)
    checked = []
    for path in sorted(autotune.SHIPPED_DIR.glob("*.json")):
        for name, result in json.loads(path.read_text())["results"].items():
            kernel = name.split("/")[1].removesuffix(".autotune.json")
            if kernel in keys:
                assert any(made_by(result["key"], names) for names in keys[kernel]), (path.name, name)
                checked.append(kernel)
    assert "_dqkwg_kernel" in checked  # the bundles hold flame's kernels: the check ran
    # A key one argument short, as the dh recurrence's entries were before LOCAL_DV joined its key, is caught.
    dhu = keys["_dhu_kernel"][0]
    assert not made_by([6, 6, 256, 512, 64, True, True, "tf32", "torch.bfloat16", "torch.float32"], dhu)
    assert made_by([6, 6, 256, 512, 64, True, True, "tf32", False, "torch.bfloat16", "torch.float32"], dhu)


def test_the_bundle_script_reads_a_cache_archive(tmp_path, capsys):
    """scripts/autotune_bundle.py on a .tar.gz of a cache (what a GPU call brings back) and on a folder."""
    import importlib.util
    import tarfile

    spec = importlib.util.spec_from_file_location(
        "autotune_bundle", Path(__file__).resolve().parents[2] / "scripts" / "autotune_bundle.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cache = tmp_path / "root" / ".triton" / "cache"
    timings = [
        [{"kwargs": {"BLOCK": 16}, "num_warps": 4}, [2.0]],
        [{"kwargs": {"BLOCK": 32}, "num_warps": 8}, [1.0]],
    ]
    for folder in ("A" * 52, "B" * 52, "D" * 52):
        (cache / folder).mkdir(parents=True)
        # D timed its first configuration only (a GPU test's choice): not shipped
        chosen = timings[:1] if folder[0] == "D" else timings
        (cache / folder / "k.autotune.json").write_text(
            json.dumps({"key": [folder[0]], "configs_timings": chosen})
        )
    (cache / "C").mkdir()  # a compiled kernel's folder: no autotuning result
    (cache / "C" / "k.json").write_text("{}")
    archive = tmp_path / "tune.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:  # as a device call packs ~/.triton/cache: nested under root/
        tar.add(cache / ("A" * 52), arcname="root/.triton/cache/" + "A" * 52)
    out = tmp_path / "bundle.json"
    common = ["--device", "NVIDIA H200", "--triton", "3.6.0", "--out", str(out)]
    assert script.main([str(archive), *common]) == 0
    assert "1 results read, 1 in all" in capsys.readouterr().out
    assert script.main([str(cache), *common]) == 0
    assert list(json.loads(out.read_text())["results"]) == [
        f"{'A' * 52}/k.autotune.json",
        f"{'B' * 52}/k.autotune.json",
    ]
    with pytest.raises(SystemExit):  # nothing there to ship: one line, not an unchanged bundle
        script.main([str(cache / ("D" * 52)), *common])
    # On an H100 the H200's bundle seeded A's entry: the H100's bundle takes only what was tuned there (B).
    shipped = tmp_path / "shipped"
    script.main(
        [str(cache / ("A" * 52)), *common[:4], "--out", str(autotune.bundle_path("NVIDIA H200", shipped))]
    )
    h100 = ["--device", "NVIDIA H100 80GB HBM3", "--triton", "3.6.0", "--shipped", str(shipped)]
    assert script.main([str(cache), *h100]) == 0
    assert "1 results read, 1 in all (NVIDIA H100 80GB HBM3, Triton 3.6.0); 1 left out, seeded from" in (
        capsys.readouterr().out
    )
    h100_bundle = json.loads(autotune.bundle_path("NVIDIA H100 80GB HBM3", shipped).read_text())
    assert list(h100_bundle["results"]) == [f"{'B' * 52}/k.autotune.json"]
    # Another Triton's H200 bundle seeds nothing: A was tuned here.
    assert autotune.sibling_entries("NVIDIA H100 80GB HBM3", "3.7.0", shipped) == {}
    with pytest.raises(SystemExit):  # only seeded entries: nothing tuned here to ship
        script.main([str(cache / ("A" * 52)), *h100])


TRITON_CONFIGS = [triton.Config({"BLOCK": block}) for block in (16, 32, 64)]


def autotuned_kernel_of(module: str):
    def kernel(x, BLOCK: tl.constexpr):
        pass

    kernel.__module__ = module
    return triton.autotune(configs=TRITON_CONFIGS, key=[])(triton.jit(kernel))


def benchmarked_configs(kernel, runs) -> tuple[list[int], triton.Config]:
    """Which configs' BLOCK a tuning round of ``kernel`` under fla_kernels_on_first_config compiled (each runs where
    ``runs(BLOCK)``), and the config Triton picks."""
    compiled = []

    def bench(self, *args, config, **kwargs):
        compiled.append(config.kwargs["BLOCK"])
        return [1.0 / config.kwargs["BLOCK"]] * 3 if runs(config.kwargs["BLOCK"]) else autotune.NOT_RUN

    from triton.runtime.autotuner import Autotuner

    original = Autotuner._bench
    Autotuner._bench = bench
    try:
        with autotune.fla_kernels_on_first_config():
            configs = kernel.prune_configs({})
            timings = {config: kernel._bench(config=config) for config in configs}  # as Autotuner.run's round
    finally:
        Autotuner._bench = original
    return compiled, min(timings, key=timings.get)


def test_fla_kernels_run_their_first_config_that_runs_and_others_tune():
    fla_kernel = autotuned_kernel_of("fla.ops.gated_delta_rule.chunk")
    assert benchmarked_configs(fla_kernel, lambda block: True) == ([16], TRITON_CONFIGS[0])
    # The first config does not fit the GPU (Triton's benchmark reports it as not run): the next one serves.
    assert benchmarked_configs(fla_kernel, lambda block: block > 16) == ([16, 32], TRITON_CONFIGS[1])
    # A new round (another key) starts again from the first config.
    assert benchmarked_configs(fla_kernel, lambda block: True) == ([16], TRITON_CONFIGS[0])
    for module in ("flame.ops.short_conv.triton_kernel", "flash_qla.ops"):
        assert benchmarked_configs(autotuned_kernel_of(module), lambda block: True) == (
            [16, 32, 64],
            TRITON_CONFIGS[2],
        )


def test_a_kernels_own_pruning_comes_first():
    def keep_large(configs, named_args, **kwargs):
        return [config for config in configs if config.kwargs["BLOCK"] >= 32]

    def kernel(x, BLOCK: tl.constexpr):
        pass

    kernel.__module__ = "fla.ops.y"
    tuned = triton.autotune(
        configs=TRITON_CONFIGS, key=[], prune_configs_by={"early_config_prune": keep_large}
    )(triton.jit(kernel))
    tuned.nargs = {"x": None}
    assert benchmarked_configs(tuned, lambda block: True) == ([32], TRITON_CONFIGS[1])


def test_fla_kernels_first_configs_stay_out_of_tritons_cache_and_the_autotuner_is_restored():
    from triton.runtime.autotuner import Autotuner

    originals = Autotuner.prune_configs, Autotuner._bench, Autotuner.check_disk_cache
    seen = []
    Autotuner.check_disk_cache = lambda self, key, configs, bench_fn: (
        seen.append(self.base_fn.__module__) or True
    )
    try:
        with autotune.fla_kernels_on_first_config():
            benched = []
            for module in ("fla.ops.x", "flame.ops.y"):
                kernel = autotuned_kernel_of(module)
                assert kernel.check_disk_cache(
                    ("key",), TRITON_CONFIGS, lambda module=module: benched.append(module)
                ) == (module == "flame.ops.y")
        assert benched == ["fla.ops.x"] and seen == ["flame.ops.y"]  # FLA's: benchmarked, never cached
    finally:
        Autotuner.check_disk_cache = originals[2]
    assert (Autotuner.prune_configs, Autotuner._bench, Autotuner.check_disk_cache) == originals
