"""flame.launch_local: a node's ranks started as torchrun would start them (environment, logs, console, signals,
failures, status)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flame import launch_local

PROBE = textwrap.dedent("""
    import os, signal, sys, time
    action = sys.argv[1]
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT"]
    if action == "fail_last":  # the last rank fails, the others wait to be stopped
        last = os.environ["RANK"] == str(int(os.environ["WORLD_SIZE"]) - 1)
        action, sys.argv[2:] = ("exit", ["3"]) if last else ("sleep", [])
    print("out", " ".join(f"{name}={os.environ.get(name)}" for name in names), flush=True)
    print("err", os.getpid(), "own session" if os.getsid(0) == os.getpid() else "launcher's session",
          file=sys.stderr, flush=True)
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "term":  # a rank's preemption handler: note the signal, finish, exit 0
        # os.write and os._exit, as flame's own handler (flame.checkpoint.preemption) does: the handler can run
        # inside print("waiting")'s flush, where print would re-enter the stream and sys.exit raise out of it.
        signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b"got SIGTERM\\n"), os._exit(0)))
    if action == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if action in ("term", "deaf", "sleep"):
        print("waiting", os.getpid(), flush=True)
        time.sleep(120)
    if action == "flood":  # more than a pipe holds, after the console has gone
        print("waiting", os.getpid(), flush=True)
        time.sleep(1)
        for i in range(3000):
            print(f"line {i:05d} " + "x" * 90, flush=True)
""")


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    (tmp_path / "rank_probe.py").write_text(PROBE)
    return tmp_path


def launcher_command(logs: Path, *args: str, shown: str = "0", ranks: int = 1) -> list[str]:
    return [sys.executable, "-m", "flame.launch_local", "--nproc-per-node", str(ranks), "--log-dir", str(logs),
            "--local-ranks-filter", shown, "--master-port", "29123", "-m", "rank_probe", *args]  # fmt: skip


def launch(probe: Path, *args: str, shown: str = "0", ranks: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{probe}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(launcher_command(probe / "logs", *args, shown=shown, ranks=ranks), capture_output=True,
                          text=True, env=env, timeout=60)  # fmt: skip


def rank_logs(probe: Path, rank: int = 0) -> Path:
    (folder,) = (probe / "logs").glob(f"none_*/attempt_0/{rank}")
    return folder


def test_the_rank_gets_torchruns_environment_and_its_lines_are_prefixed_and_logged(probe):
    result = launch(probe, "exit", "0")
    assert result.returncode == 0, result.stderr
    values = "RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 MASTER_PORT=29123"
    assert result.stdout == f"[rank0]:out {values}\n"
    (err,) = result.stderr.splitlines()
    assert err.startswith("[rank0]:err ") and err.endswith(" own session")
    folder = rank_logs(probe)
    assert (folder / "stdout.log").read_text() == f"out {values}\n"
    assert (folder / "stderr.log").read_text() == err.removeprefix("[rank0]:") + "\n"


@pytest.mark.parametrize("preset, expected", [(None, "1"), ("3", "3")])
def test_a_ranks_environment_is_torchruns_for_its_place_on_the_node(monkeypatch, preset, expected):
    """torchrun's agent sets NCCL's error handling to 1 (tear down) unless the caller chose a mode."""
    if preset is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", preset)
    assert launch_local.rank_env(2, 4, "node0", "29123") == {
        "RANK": "2", "LOCAL_RANK": "2", "GROUP_RANK": "0", "ROLE_RANK": "2", "ROLE_NAME": "rank", "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "node0",
        "MASTER_PORT": "29123", "TORCH_NCCL_ASYNC_ERROR_HANDLING": expected,
    }  # fmt: skip


def test_each_rank_gets_its_place_in_the_world_and_the_filter_picks_the_console_lines(probe):
    result = launch(probe, "exit", "0", shown="1,2", ranks=3)
    assert result.returncode == 0, result.stderr
    values = "WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 GROUP_RANK=0 MASTER_PORT=29123"
    assert (
        result.stdout
        == f"[rank1]:out RANK=1 LOCAL_RANK=1 {values}\n[rank2]:out RANK=2 LOCAL_RANK=2 {values}\n"
        or (
            result.stdout
            == f"[rank2]:out RANK=2 LOCAL_RANK=2 {values}\n[rank1]:out RANK=1 LOCAL_RANK=1 {values}\n"
        )
    )
    for rank in range(3):
        log = (rank_logs(probe, rank) / "stdout.log").read_text()
        assert log == f"out RANK={rank} LOCAL_RANK={rank} {values}\n"


def test_the_first_failed_rank_stops_the_others_and_the_report_names_it(probe):
    started = time.monotonic()
    result = launch(probe, "fail_last", ranks=3)
    assert result.returncode == 1 and time.monotonic() - started < 30  # the others would sleep 120 s
    report = result.stderr.splitlines()[-1]
    assert report.startswith("rank_probe failed: rank 2 (local_rank 2, pid "), report
    assert (
        "exitcode : 3;" in report
        and f"then stopped: rank 0 {-signal.SIGTERM}, rank 1 {-signal.SIGTERM};" in report
    )


def test_a_hidden_rank_is_only_logged(probe):
    result = launch(probe, "exit", "0", shown="1,2")
    assert result.returncode == 0 and result.stdout == "" and result.stderr == ""
    assert (rank_logs(probe) / "stdout.log").read_text().startswith("out RANK=0 ")


@pytest.mark.parametrize("args, code", [(("exit", "3"), 3), (("kill",), -signal.SIGKILL)])
def test_a_failed_rank_exits_1_after_a_report_with_its_exit_code(probe, args, code):
    result = launch(probe, *args)
    assert result.returncode == 1
    report = result.stderr.splitlines()[-1]
    assert (
        report.startswith("rank_probe failed: rank 0 (local_rank 0, pid ") and f"exitcode : {code};" in report
    )


def start(probe: Path, action: str, ranks: int = 1) -> tuple[subprocess.Popen, list[int]]:
    """The launcher running the probe until every rank waits; the ranks' pids."""
    env = {**os.environ, "PYTHONPATH": f"{probe}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    shown = ",".join(map(str, range(ranks)))
    process = subprocess.Popen(launcher_command(probe / "logs", action, shown=shown, ranks=ranks),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    pids = []
    for line in process.stdout:
        if "]:waiting " in line:
            pids.append(int(line.split()[1]))
            if len(pids) == ranks:
                return process, pids
    raise AssertionError(f"a rank ended before waiting: {process.communicate()}")


def test_a_closed_console_leaves_the_rank_running_and_logging(probe):
    process, _ = start(probe, "flood")
    process.stdout.close()  # e.g. train.sh ... | head
    assert process.wait(timeout=60) == 0
    lines = (rank_logs(probe) / "stdout.log").read_text().splitlines()
    assert len(lines) == 3002 and lines[-1].startswith("line 02999 ")


def test_sigterm_to_the_launcher_reaches_every_rank(probe):
    process, _ = start(probe, "term", ranks=2)
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and sorted(stdout.splitlines()) == [
        "[rank0]:got SIGTERM",
        "[rank1]:got SIGTERM",
    ]


def gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # ended, not yet reaped by its new parent
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_rank_ends_with_the_launcher_even_on_sigkill(probe):
    process, pids = start(probe, "sleep", ranks=2)
    process.kill()
    process.communicate(timeout=60)
    assert all(gone(pid, within_s=10) for pid in pids)


def test_a_rank_that_ignores_the_forwarded_signal_is_killed_after_the_grace_time(probe, monkeypatch):
    """In this process (the grace time shortened): SIGTERM forwarded, ignored by the rank, then SIGKILL."""
    monkeypatch.setenv("PYTHONPATH", f"{probe}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(launch_local, "KILL_AFTER_S", 1.0)
    handlers = {signum: signal.getsignal(signum) for signum in launch_local.FORWARDED_SIGNALS}
    log = probe / "logs"

    def signal_when_waiting():
        end = time.monotonic() + 60
        while time.monotonic() < end:
            logs = list(log.glob("none_*/attempt_0/0/stdout.log"))
            if logs and "waiting" in logs[0].read_text():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    threading.Thread(target=signal_when_waiting, daemon=True).start()
    started = time.monotonic()
    try:
        status = launch_local.main(launcher_command(log, "deaf", shown="")[3:])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert status == 1 and time.monotonic() - started < 30
