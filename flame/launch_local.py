"""Starts the ranks of a one-node job (NNODE=1) as train.sh's torchrun would, without torchrun.

torchrun imports torch and its elastic agent before it starts a rank, a second or more of every launch
(docs/performance.md, "Start-up imports"); the ranks of one node rendezvous through rank 0's store (MASTER_ADDR and
MASTER_PORT), with no agent needed. This launcher imports no torch and keeps what train.sh, its tests and users'
scripts rely on from torchrun:

- each rank's environment as torchrun sets it on one node (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ...,
  TORCH_NCCL_ASYNC_ERROR_HANDLING), with ``--master-addr`` and ``--master-port`` as MASTER_ADDR and MASTER_PORT;
- each rank's output, every line in ``<log-dir>/none_<random>/attempt_0/<rank>/{stdout,stderr}.log`` (torchrun's
  layout for its default run id) and, for the ranks ``--local-ranks-filter`` names, on this process's stdout and
  stderr behind ``[rank<N>]:``, whole lines;
- each rank in a session of its own, killed by the kernel when this process ends (Linux's parent-death signal);
- SIGTERM, SIGINT, SIGHUP and SIGQUIT passed on to every rank, which then have 30 s to end before SIGKILL;
- the first rank to fail stops the others (SIGTERM, SIGKILL 30 s later), as torchrun's agent does;
- exit status 0 when every rank succeeded, else 1 after a report on stderr naming the rank that failed first (its
  exit code, negative for the signal that ended it, as ``exitcode : N`` like torchrun's) and the others' codes.

Usage (train.sh): ``python -m flame.launch_local --nproc-per-node N [--log-dir DIR] [--local-ranks-filter 0]
-m flame.train ARGS``.
"""

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

from flame.process_end import end_with_parent

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
KILL_AFTER_S = 30.0  # torchrun's shutdown timeout
MONITOR_INTERVAL_S = 0.1  # torchrun's default
OUTPUT_DRAIN_S = 5.0  # a rank's child that outlives it may hold its pipes open


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The launcher's options, then ``-m MODULE``; everything after the module is the ranks', as with python -m."""
    parser = argparse.ArgumentParser(prog="python -m flame.launch_local", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks to start")
    parser.add_argument("--log-dir", default=".", help="folder for the ranks' log files")
    parser.add_argument(
        "--local-ranks-filter", default="0", help="ranks shown on the console (comma separated)"
    )
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "localhost"))
    parser.add_argument("--master-port", default=os.environ.get("MASTER_PORT", "29500"))
    parser.add_argument("-m", dest="module", required=True, help="the ranks' module, run as python -m MODULE")
    end = argv.index("-m") + 2 if "-m" in argv else len(argv)
    args = parser.parse_args(argv[:end])
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be at least 1, not {args.nproc_per_node}")
    args.args = argv[end:]
    return args


def rank_env(rank: int, world_size: int, master_addr: str, master_port: str) -> dict[str, str]:
    """What torchrun's agent exports to a rank of a one-node job
    (torch.distributed.elastic.agent.server.local_elastic_agent), less its own store and run id."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "rank",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def run_log_folder(log_dir: Path) -> Path:
    """``<log_dir>/none_<random>/attempt_0``: the ranks' folders go inside."""
    log_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="none_", dir=log_dir)) / "attempt_0"


class Console:
    """One of this process's streams, shared by the ranks' copying threads: whole lines, and once it is gone (a
    closed pipe, a hung-up terminal) the ranks' lines go to their logs only."""

    def __init__(self, stream: BinaryIO):
        self.stream: BinaryIO | None = stream
        self.lock = threading.Lock()

    def write(self, line: bytes) -> None:
        with self.lock:
            if self.stream is None:
                return
            try:
                self.stream.write(line)
                self.stream.flush()
            except OSError:
                self.stream = None


def copy_lines(source: BinaryIO, log_path: Path, console: Console | None, prefix: bytes) -> None:
    """Each line of ``source`` to the log file and, behind ``prefix``, to ``console`` while it takes them. The
    rank's pipe is read to its end whatever the console does: a rank whose pipe fills stops at its next print."""
    with open(log_path, "ab") as log:
        for line in iter(source.readline, b""):
            log.write(line)
            log.flush()
            if console is not None:
                console.write(prefix + line)


def failure_report(
    module: str, codes: dict[int, int], first: list[int], pids: dict[int, int], logs: Path
) -> str:
    """The line that says which rank failed first (torchrun's root cause) with its exit code, and how the others
    ended."""
    cause = "; ".join(f"rank {r} (local_rank {r}, pid {pids[r]}) exitcode : {codes[r]}" for r in first)
    others = ", ".join(f"rank {r} {codes[r]}" for r in sorted(codes) if r not in first)
    return f"{module} failed: {cause}" + (f"; then stopped: {others}" if others else "") + f"; logs in {logs}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shown = {rank.strip() for rank in args.local_ranks_filter.split(",")}
    run_logs = run_log_folder(Path(args.log_dir))
    consoles = (Console(sys.stdout.buffer), Console(sys.stderr.buffer))
    ranks: dict[int, subprocess.Popen] = {}
    kill_at = None

    def stop(signum: int) -> None:
        nonlocal kill_at
        for process in ranks.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)
        if kill_at is None:
            kill_at = time.monotonic() + KILL_AFTER_S

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, lambda signum, _frame: stop(signum))
    copies = []
    for rank in range(args.nproc_per_node):
        if kill_at is not None:  # signalled while starting: start no more ranks
            break
        folder = run_logs / str(rank)
        folder.mkdir(parents=True)
        ranks[rank] = subprocess.Popen(
            [sys.executable, "-m", args.module, *args.args],
            env={**os.environ, **rank_env(rank, args.nproc_per_node, args.master_addr, args.master_port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=end_with_parent,  # run in the rank's process before its program
        )
        prefix = f"[rank{rank}]:".encode()
        for stream, name, console in ((ranks[rank].stdout, "stdout.log", consoles[0]),
                                      (ranks[rank].stderr, "stderr.log", consoles[1])):  # fmt: skip
            copy = threading.Thread(
                target=copy_lines,
                args=(stream, folder / name, console if str(rank) in shown else None, prefix),
                daemon=True,
            )
            copy.start()
            copies.append(copy)
    codes: dict[int, int] = {}
    first_failed: list[int] = []
    while len(codes) < len(ranks):
        time.sleep(MONITOR_INTERVAL_S)
        ended = {rank: process.poll() for rank, process in ranks.items() if rank not in codes}
        ended = {rank: code for rank, code in ended.items() if code is not None}
        codes.update(ended)
        failed = sorted(rank for rank, code in ended.items() if code != 0)
        if failed and not first_failed:
            first_failed = failed
            stop(signal.SIGTERM)
        if kill_at is not None and time.monotonic() > kill_at:
            for process in ranks.values():
                if process.poll() is None:
                    process.kill()
    drain_until = time.monotonic() + OUTPUT_DRAIN_S
    for copy in copies:
        copy.join(max(0.0, drain_until - time.monotonic()))
    if len(ranks) < args.nproc_per_node:
        started = f"{len(ranks)} of {args.nproc_per_node}"
        print(
            f"{args.module} stopped: a signal came while the ranks started ({started} started)",
            file=sys.stderr,
        )
        return 1
    if not first_failed:
        return 0
    pids = {rank: process.pid for rank, process in ranks.items()}
    print(failure_report(args.module, codes, first_failed, pids, run_logs), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
