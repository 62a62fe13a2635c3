"""Starts the one rank of a one-process job (NGPU=1 on one node) as train.sh's torchrun would, without torchrun.

torchrun imports torch and its elastic agent before it starts a rank, a second or more of every launch
(docs/performance.md, "Start-up imports"); one process has nothing to rendezvous. This launcher imports no torch
and keeps what train.sh, its tests and users' scripts rely on from torchrun:

- the rank's environment as torchrun sets it for one process (RANK, LOCAL_RANK, WORLD_SIZE, ...), with
  ``--master-addr`` and ``--master-port`` as MASTER_ADDR and MASTER_PORT;
- its output, every line in ``<log-dir>/none_<random>/attempt_0/0/{stdout,stderr}.log`` (torchrun's layout for its
  default run id) and, where ``--local-ranks-filter`` names rank 0, on this process's stdout and stderr behind
  ``[rank0]:``;
- the rank in a session of its own, killed by the kernel when this process ends (Linux's parent-death signal);
- SIGTERM, SIGINT, SIGHUP and SIGQUIT passed on to the rank, which then has 30 s to end before SIGKILL;
- exit status 0 when the rank succeeded, else 1 after a report on stderr with the rank's exit code (negative: the
  signal that ended it), as ``exitcode : N`` like torchrun's.

Usage (train.sh): ``python -m flame.launch_single [--log-dir DIR] [--local-ranks-filter 0] -m flame.train ARGS``.
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

# What torchrun's agent exports to each rank (torch.distributed.elastic.agent.server.local_elastic_agent).
RANK_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "ROLE_RANK": "0",
    "ROLE_NAME": "rank",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_WORLD_SIZE": "1",
}
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
KILL_AFTER_S = 30.0  # torchrun's shutdown timeout
OUTPUT_DRAIN_S = 5.0  # a rank's child that outlives it may hold its pipes open


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The launcher's options, then ``-m MODULE``; everything after the module is the rank's, as with python -m."""
    parser = argparse.ArgumentParser(prog="python -m flame.launch_single", description=__doc__.split("\n")[0])
    parser.add_argument("--log-dir", default=".", help="folder for the rank's log files")
    parser.add_argument(
        "--local-ranks-filter", default="0", help="ranks shown on the console (comma separated)"
    )
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "localhost"))
    parser.add_argument("--master-port", default=os.environ.get("MASTER_PORT", "29500"))
    parser.add_argument("-m", dest="module", required=True, help="the rank's module, run as python -m MODULE")
    end = argv.index("-m") + 2 if "-m" in argv else len(argv)
    args = parser.parse_args(argv[:end])
    args.args = argv[end:]
    return args


def rank_log_folder(log_dir: Path) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="none_", dir=log_dir))
    folder = run / "attempt_0" / "0"
    folder.mkdir(parents=True)
    return folder


def copy_lines(source: BinaryIO, log_path: Path, console: BinaryIO | None) -> None:
    """Each line of ``source`` to the log file and, behind the rank's prefix, to ``console`` while it takes them.
    The rank's pipe is read to its end whatever the console does: a rank whose pipe fills stops at its next print."""
    with open(log_path, "ab") as log:
        for line in iter(source.readline, b""):
            log.write(line)
            log.flush()
            if console is not None:
                try:
                    console.write(b"[rank0]:" + line)
                    console.flush()
                except OSError:  # the console is gone (a closed pipe, a hung-up terminal): the log keeps all
                    console = None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shown = "0" in {rank.strip() for rank in args.local_ranks_filter.split(",")}
    log_folder = rank_log_folder(Path(args.log_dir))
    env = {**os.environ, **RANK_ENV, "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port)}
    rank = subprocess.Popen(
        [sys.executable, "-m", args.module, *args.args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=end_with_parent,  # run in the rank's process before its program
    )
    kill_at = None

    def forward(signum, _frame) -> None:
        nonlocal kill_at
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank.pid, signum)
        if kill_at is None:
            kill_at = time.monotonic() + KILL_AFTER_S

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    copies = [
        threading.Thread(target=copy_lines, args=(stream, log_folder / name, console), daemon=True)
        for stream, name, console in (
            (rank.stdout, "stdout.log", sys.stdout.buffer if shown else None),
            (rank.stderr, "stderr.log", sys.stderr.buffer if shown else None),
        )
    ]
    for copy in copies:
        copy.start()
    while True:
        try:
            code = rank.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if kill_at is not None and time.monotonic() > kill_at:
                rank.kill()
    drain_until = time.monotonic() + OUTPUT_DRAIN_S
    for copy in copies:
        copy.join(max(0.0, drain_until - time.monotonic()))
    if code == 0:
        return 0
    print(
        f"{args.module} failed: rank 0 (local_rank 0, pid {rank.pid}) exitcode : {code}; its output is in {log_folder}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
