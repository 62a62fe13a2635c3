"""bench/first_step.py (a GPU benchmark) on the CPU: the time to the first step's log line read from a launch's
output as it comes, the shipped tuning results it reports, a launch past its time limit killed with its children,
and each case's caches: fresh and fresh-with-shipped-tuning empty and apart, warm the second one's again."""

import logging
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import first_step  # noqa: E402

from tests.utils.helpers import process_ends  # noqa: E402


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_first_step_line_is_timed_as_it_comes(tmp_path):
    launch = python(
        "import time\n"
        "print('launcher: pre-flight', flush=True)\n"
        "time.sleep(0.3)\n"
        "print('[rank0]: wrote 37 of flame\\'s tuning results for NVIDIA H200 into ...', flush=True)\n"
        "print('[rank0]:[titan] Training starts at step 1', flush=True)\n"
        "time.sleep(0.5)\n"
        "print('[rank0]:[titan] step  1/1  loss 8.3606  grad_norm 3.254', flush=True)\n"
        "time.sleep(1.5)  # the end of the run is not the first step\n"
    )
    seconds, note, phases = first_step.time_to_first_step(launch, {}, tmp_path / "a.log", 30)
    assert 0.8 <= seconds < 2.1 and note == "shipped results written: 37"
    assert list(phases) == ["start", "setup", "step 1"] and abs(sum(phases.values()) - seconds) < 1e-9
    # Each phase ends when its line is read: a line read late lengthens one phase and shortens the next, so the
    # step's 0.5 s sleep reads as at least 0.4 s on a loaded machine (0.498 s seen in CI).
    assert phases["start"] >= 0.3 and phases["setup"] < 0.25 and phases["step 1"] >= 0.4
    assert "step  1/1" in (tmp_path / "a.log").read_text()


def tuning_lines(tmp_path, caplog, seconds: list[float]) -> list[str]:
    """flame.ops.autotune's lines for one kernel tuned at a key per entry of ``seconds``, each taking that long."""
    from flame.ops import autotune

    def benchmark_and_write(
        tuner, key, configs, bench
    ):  # Triton's check_disk_cache where the cache holds none
        bench()
        return False

    check = autotune.locked(benchmark_and_write, tmp_path / "locks")
    kernel = SimpleNamespace(
        base_fn=SimpleNamespace(__name__="_dhu_kernel"), fn=SimpleNamespace(cache_key="k")
    )
    configs = [SimpleNamespace(pre_hook=None, block=block) for block in (16, 32)]
    with caplog.at_level(logging.INFO, logger=autotune.__name__):
        for key, wait in enumerate(seconds):
            check(kernel, (key, 256), configs, lambda wait=wait: time.sleep(wait))
    return [r.getMessage() for r in caplog.records if "tuned Triton kernel" in r.getMessage()]


def test_the_kernels_the_ranks_tuned_are_counted(tmp_path, caplog):
    prints = "".join(
        f"print({f'[rank0]: {line}'!r}, flush=True)\n" for line in tuning_lines(tmp_path, caplog, [0.2, 0.3])
    )
    launch = python(f"{prints}print('[rank0]:[titan] step  1/1  loss 8.3606', flush=True)\n")
    seconds, note, _ = first_step.time_to_first_step(launch, {}, tmp_path / "t.log", 30)
    assert seconds == seconds and re.fullmatch(
        r"kernels tuned by the ranks: 2 \(0\.[5-9] s: _dhu_kernel x2\)", note
    )


def test_the_kernels_the_prewarm_tuned_are_counted_from_its_log(tmp_path, caplog):
    dump = tmp_path / "dump"
    assert first_step.prewarm_tuning(dump) == ""  # no prewarm (a CPU launch, or FLAME_PREWARM=0)
    (dump / "logs").mkdir(parents=True)
    lines = [f"prewarm: {line}" for line in tuning_lines(tmp_path, caplog, [0.2])]
    (dump / "logs" / "prewarm.log").write_text(
        "\n".join([*lines, "prewarm: gated_deltanet: layers 0 in 9.0 s"])
    )
    assert re.fullmatch(
        r"kernels tuned by the prewarm: 1 \(0\.[2-9] s: _dhu_kernel\)", first_step.prewarm_tuning(dump)
    )
    # The lines themselves, with the key each kernel tuned at, for the bench's output.
    caplog.clear()
    ranks = ["[rank0]: step 1/1", *[f"[rank0]: {line}" for line in tuning_lines(tmp_path, caplog, [0.1])]]
    whole = first_step.tuning_lines(ranks, first_step.prewarm_lines(dump))
    assert len(whole) == 2 and all("tuned Triton kernel _dhu_kernel" in line for line in whole)
    assert all("key (" in line for line in whole), whole


def test_a_launch_without_a_step_says_why(tmp_path):
    launch = python("print('[rank0]:error: the tokenizer has 4096 tokens'); raise SystemExit(1)")
    seconds, note, phases = first_step.time_to_first_step(launch, {}, tmp_path / "b.log", 30)
    assert seconds != seconds and note == "[rank0]:error: the tokenizer has 4096 tokens"
    assert list(phases) == ["start"]  # the rank spoke, and stopped before training started


def test_a_launch_past_its_limit_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    launch = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    started = time.perf_counter()
    seconds, note, _ = first_step.time_to_first_step(launch, {}, tmp_path / "c.log", 1)
    assert time.perf_counter() - started < 10 and seconds != seconds and note == "no step within 1 s"
    child = int(pid_file.read_text())
    assert process_ends(child), "the launch's child outlived its limit"


def test_fresh_cases_start_from_empty_caches_and_warm_reuses_them(tmp_path, monkeypatch):
    seen = []

    def time_to_first_step(command, env, log, timeout_s):
        caches = [
            Path(env[variable])
            for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TILELANG_CACHE_DIR")
        ]
        assert len(set(caches)) == 3  # each compiler's own folder
        flags = (env["FLAME_SHIPPED_TUNING"], env["FLAME_PREWARM"])
        seen.append((flags, caches, any(cache.exists() for cache in caches), command))
        for cache in caches:
            cache.mkdir(parents=True, exist_ok=True)
        return 1.0 + len(seen), "", {"start": 0.5, "setup": 0.25, "step 1": 0.25 + len(seen)}

    monkeypatch.setattr(first_step, "time_to_first_step", time_to_first_step)
    args = first_step.parse(["--device", "cpu", "--tiny", "--models", "gated_deltanet", "--seq_len", "64"])
    row = first_step.measure_model("gated_deltanet", args, tmp_path)
    flags, caches, existed, commands = zip(*seen)
    # fresh; shipped tuning without the prewarm; shipped tuning with it; warm: the last one's caches again.
    assert flags == (("0", "1"), ("1", "0"), ("1", "1"), ("1", "1"))
    assert existed == (False, False, False, True)
    assert len({tuple(c) for c in caches[:3]}) == 3 and caches[2] == caches[3]
    command = commands[-1]
    assert command[command.index("--training.seq_len") + 1] == "64" and "--compile.enable" not in command
    assert row["seconds"] == dict(zip(first_step.CASES, (2.0, 3.0, 4.0, 5.0)))
    assert first_step.table([row]).splitlines()[-1] == (
        "| gated_deltanet | 2.0 | 3.0 | 4.0 | 5.0 | fresh: start 0.5 + setup 0.2 + step 1 1.2 s; fresh, shipped "
        "tuning, no prewarm: start 0.5 + setup 0.2 + step 1 2.2 s; fresh, shipped tuning: start 0.5 + setup 0.2 + "
        "step 1 3.2 s; warm: start 0.5 + setup 0.2 + step 1 4.2 s |  |"
    )


def test_cases_pick_the_launches_and_the_table_columns(tmp_path, monkeypatch):
    shipped_flags = []

    def time_to_first_step(command, env, log, timeout_s):
        shipped_flags.append(env["FLAME_SHIPPED_TUNING"])
        return 5.0, "", {"start": 5.0}

    monkeypatch.setattr(first_step, "time_to_first_step", time_to_first_step)
    args = first_step.parse(
        ["--device", "cpu", "--tiny", "--models", "transformer", "--cases", "warm,shipped"]
    )
    row = first_step.measure_model("transformer", args, tmp_path)
    assert shipped_flags == ["1", "1"] and list(row["seconds"]) == ["fresh, shipped tuning", "warm"]
    header = first_step.table([row]).splitlines()[0]
    assert header == "| model | fresh, shipped tuning s | warm s | where the time went | notes |"


def test_warm_without_shipped_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        first_step.parse(["--device", "cpu", "--cases", "fresh,warm"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("add shipped")
