"""Chaos test: a small job killed at random moments, then finished, must end with the weights of an uninterrupted run.

    python scripts/chaos.py --trials 20 [--ngpu 2] [--seed 0] [--workdir DIR] [--json FILE] [--time_limit S]
        [--check_repeat] [-- extra train.sh flags]

First the job runs uninterrupted (the reference). Then the same job is launched again and again in another dump
folder (through train.sh, so every launch resumes from the latest checkpoint that verifies), each launch (a trial)
hit by one of the following; when the job has reached its last step it is checked and started again in a new
folder, until the trials are done (or ``--time_limit`` seconds have passed: then no trial starts, and the job in
progress is finished and checked as usual):

- ``sigterm``: SIGTERM to train.sh after a random number of steps: the ranks must finish their step, save it and
  exit with 75; the saved step must be the last step the launch logged (no step lost);
- ``sigkill``: SIGKILL to every process of the launch after a random number of steps (a node that dies);
- ``sigkill_save``: SIGKILL while a checkpoint is being written (a ``step-<N>.partial`` directory exists);
- ``sigkill_purge``: SIGKILL while an old checkpoint is being deleted (a ``step-<N>.purging`` directory exists),
  or, if the purge is over before it is seen, right after.

After the trials one more launch runs the job to its end. Every entry of each job's final checkpoint (model,
optimizer, schedule, dataloader, torch's RNG and train state) must equal the reference's bit for bit; a job that
does is then deleted (its checkpoints), one that does not is kept for a look. With ``--trials 0`` (or a time
limit of 0) the one job is run uninterrupted a second time: whether the job repeats bit for bit at all, on this
machine. ``--check_repeat`` runs the uninterrupted job twice before any trial and stops with exit status 3 if the
two differ: on such a machine (a GPU whose kernels pick different configurations from run to run, say) a mismatch
would not tell a checkpoint fault. Prints a line per trial and per checked job, and a summary; exit status 0 only
with no mismatch, no step lost and every launch ending as its kind requires.
"""

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("sigterm", "sigkill", "sigkill_save", "sigkill_purge")
EXIT_PREEMPTED = 75  # flame.checkpoint.preemption.EXIT_PREEMPTED (not imported: this script stays torch-free)
# Small enough for CPU, long enough for several saves and purges: 12 steps, a checkpoint every 3, keep 2.
JOB = ["--training.steps", "12", "--training.seq_len", "64", "--training.batch_size", "2",
       "--training.num_workers", "2", "--training.seed", "7", "--lr_scheduler.warmup_steps", "2",
       "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "2", "--metrics.log_freq", "1"]  # fmt: skip
STEP_LINE = re.compile(r"step +(\d+)/\d+ ")
# 50 ports per run, below Linux's ephemeral range (32768+, where NCCL's and gloo's own sockets bind): runs started
# together (several on one host) get disjoint ranges unless their process ids differ by a multiple of 250.
PORTS = itertools.count(20000 + os.getpid() % 250 * 50)


class Launch:
    """One train.sh run in its own session (so that SIGKILL reaches torchrun and every rank)."""

    def __init__(self, dump: Path, ngpu: int, flags: list[str]):
        dump.parent.mkdir(parents=True, exist_ok=True)
        self.dump = dump
        self.earlier_logs = set(
            (dump / "logs").glob("*")
        )  # torchrun writes each launch's logs into a new folder
        self.log_path = dump.parent / f"{dump.name}.launch.log"
        self.started = time.time()
        env = {**os.environ, "NGPU": str(ngpu), "MASTER_PORT": str(next(PORTS)), "FLAME_EXPORT_HF": "0",
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                ["bash", str(REPO / "train.sh"), "--job.dump_folder", str(dump), *flags],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def logged_steps(self) -> list[int]:
        """Steps rank 0 has logged so far in this launch (its live log file under <dump>/logs)."""
        steps = []
        for folder in set((self.dump / "logs").glob("*")) - self.earlier_logs:
            for log in folder.glob("attempt_0/0/stdout.log"):
                steps += [int(m.group(1)) for m in STEP_LINE.finditer(log.read_text(errors="replace"))]
        return steps

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float = 600) -> int:
        return self.process.wait(timeout)

    def kill_all(self) -> None:
        """SIGKILL train.sh, torchrun, every rank and dataloader worker (torchrun starts each rank in a session of
        its own, so killing train.sh's process group would leave the ranks running)."""
        parents = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        tree, queue = [], [self.process.pid]
        while queue:
            pid = queue.pop()
            tree.append(pid)
            queue += parents.get(pid, [])
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def checkpoint_dirs(dump: Path, suffix: str, since: float = 0.0) -> list[Path]:
    """step-<N><suffix> directories created (or renamed to that name) at ``since`` or later; killed launches leave
    older ones behind."""
    folder = dump / "checkpoint"
    found = []
    for path in folder.glob(f"step-*{suffix}") if folder.is_dir() else []:
        try:
            if path.stat().st_ctime >= since:
                found.append(path)
        except FileNotFoundError:  # purged in between
            pass
    return found


def poll(condition, run: Launch, timeout: float = 300, interval: float = 0.005) -> bool:
    """Wait until condition() holds (True) or the launch ends (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        if not run.running():
            return False
        time.sleep(interval)
    raise TimeoutError("the launch made no progress")


def run_trial(dump: Path, scenario: str, steps: int, interval: int, rng: random.Random, ngpu: int,
              flags: list[str]) -> dict:  # fmt: skip
    before = max(run_steps_done(dump), 0)
    run = Launch(dump, ngpu, flags)
    result = {"scenario": scenario, "resumed_from": before, "during_save": False, "during_purge": False}
    # A step this launch reaches; a SIGTERM before the last step, which would end the run anyway.
    target = rng.randint(before + 1, max(before + 1, steps - 1 if scenario == "sigterm" else steps))
    if scenario in ("sigterm", "sigkill"):
        hit = poll(lambda: any(s >= target for s in run.logged_steps()), run)
    elif scenario == "sigkill_save":
        hit = poll(lambda: bool(checkpoint_dirs(dump, ".partial", run.started)), run)
    else:
        # A purge follows every save once keep_latest_k checkpoints exist; if it ends unseen, the step after
        # a save is the moment right after it.
        after_save = [s + 1 for s in range(interval, steps, interval) if s + 1 >= target] or [steps]
        hit = poll(lambda: bool(checkpoint_dirs(dump, ".purging", run.started)) or max(run.logged_steps(), default=0)
                   >= after_save[0], run, interval=0.001)  # fmt: skip
    if hit:
        result["during_save"] = bool(checkpoint_dirs(dump, ".partial", run.started))
        result["during_purge"] = bool(checkpoint_dirs(dump, ".purging", run.started))
        if scenario == "sigterm":
            os.kill(run.process.pid, signal.SIGTERM)
        else:
            run.kill_all()
    status = run.wait()
    logged = run.logged_steps()
    result.update(signalled=hit, status=status, last_logged=max(logged, default=None))
    result["problems"] = []
    if scenario == "sigterm" and hit:
        marker = dump / "preempted.json"
        saved = json.loads(marker.read_text())["step"] if marker.is_file() else None
        if status == 0 and run_steps_done(dump) == steps:  # the signal came during the last step: it finished
            saved = steps
        result["saved"] = saved
        if status not in (EXIT_PREEMPTED, 0):
            result["problems"].append(f"exit status {status}, not {EXIT_PREEMPTED}")
        if saved != result["last_logged"]:
            result["problems"].append(f"saved step {saved} but logged step {result['last_logged']}")
        result["steps_lost"] = (result["last_logged"] or 0) - (saved or before)
    elif not hit and status != 0:
        result["problems"].append(f"the launch failed on its own (status {status}); see {run.log_path}")
    return result


def run_steps_done(dump: Path) -> int:
    """The step the next launch resumes from: the newest checkpoint that verifies."""
    from flame.checkpoint.layout import list_steps, step_dir
    from flame.checkpoint.verify import checkpoint_problem

    for step in sorted((s for s, ok in list_steps(dump / "checkpoint").items() if ok), reverse=True):
        if checkpoint_problem(step_dir(dump / "checkpoint", step)) is None:
            return step
    return -1


def checkpoint_entries(path: Path) -> dict:
    """Every entry of a DCP checkpoint, read in this process (tensors and plain data)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from flame.checkpoint.manager import PlainDataLoadPlanner

    metadata = FileSystemReader(str(path)).read_metadata()
    state = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif isinstance(entry, BytesStorageMetadata):
            state[key] = None
    dcp.load(state, storage_reader=FileSystemReader(str(path)), planner=PlainDataLoadPlanner(), no_dist=True)
    return state


# Python's and NumPy's global generators are not seeded (torchtitan's set_determinism seeds torch's alone), so their
# states differ between any two runs; training draws nothing from them (the data pipeline has its own generators).
UNSEEDED = ("rng.python", "rng.python_gauss", "rng.numpy", "rng.numpy_gauss")


def mismatches(reference: Path, final: Path) -> list[str]:
    import torch

    expected, got = checkpoint_entries(reference), checkpoint_entries(final)
    for key in UNSEEDED:
        expected.pop(key, None)
        got.pop(key, None)
    problems = [f"{key}: only in one checkpoint" for key in sorted(set(expected) ^ set(got))]
    for key in sorted(set(expected) & set(got)):
        a, b = expected[key], got[key]
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
        if not same:
            problems.append(f"{key} differs")
    return problems


def finish(dump: Path, reference: Launch, ngpu: int, flags: list[str], steps: int) -> list[str]:
    """Run the job in ``dump`` to its end and compare its final checkpoint with the reference's."""
    final = Launch(dump, ngpu, flags)
    if (status := final.wait()) != 0:
        return [f"the final launch in {dump} failed (status {status}); see {final.log_path}"]
    last = f"checkpoint/step-{steps}"
    problems = [f"{dump.name}: {problem}" for problem in mismatches(reference.dump / last, dump / last)]
    if problems:
        print(
            f"job {dump.name}: {len(problems)} entries differ from the reference's, first {problems[0]}",
            flush=True,
        )
    else:  # a checked job's checkpoints go: a GPU-sized model's take gigabytes per job
        print(f"job {dump.name}: its step-{steps} checkpoint equals the reference's bit for bit", flush=True)
        shutil.rmtree(dump / "checkpoint")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--ngpu", type=int, default=2, help="ranks (CPU processes without a GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--workdir", type=Path, default=Path("exp/chaos"))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated; taken in turn")
    parser.add_argument("--json", type=Path, help="write the trials and the summary here (after every trial)")
    parser.add_argument(
        "--time_limit",
        type=float,
        default=None,
        help="seconds after which no trial starts; the job in progress is still finished and compared",
    )
    parser.add_argument(
        "--check_repeat",
        action="store_true",
        help="run the uninterrupted job twice first; stop (status 3) if the two runs differ",
    )
    parser.add_argument("extra", nargs="*", help="more train.sh flags (after --)")
    args = parser.parse_args(argv)
    scenarios = args.scenarios.split(",")
    if unknown := set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    flags = JOB + args.extra
    steps = int(flags[len(flags) - 1 - flags[::-1].index("--training.steps") + 1])
    interval = int(flags[len(flags) - 1 - flags[::-1].index("--checkpoint.interval") + 1])
    rng = random.Random(args.seed)
    start = time.time()

    reference = Launch(args.workdir / "reference", args.ngpu, flags)
    if (status := reference.wait()) != 0:
        print(
            f"error: the uninterrupted run failed (status {status}); see {reference.log_path}",
            file=sys.stderr,
        )
        return 2
    if args.check_repeat and (differ := finish(args.workdir / "repeat", reference, args.ngpu, flags, steps)):
        print(
            f"error: a second uninterrupted run of the job does not equal the first ({differ[0]}), so no trial on "
            "this machine could tell a checkpoint fault; make the job repeat bit for bit first (on GPUs: one launch "
            "of the job before this script, so that every launch reads the same kernel configurations from "
            "Triton's autotuning cache)",
            file=sys.stderr,
        )
        return 3
    trials, problems, rounds = [], [], 1
    dump = args.workdir / "chaos-1"
    offset = rng.randrange(len(scenarios))
    timed_out = False
    for trial in range(args.trials):
        if timed_out := args.time_limit is not None and time.time() - start >= args.time_limit:
            print(f"time limit: {args.time_limit:.0f} s have passed; no more trials", flush=True)
            break
        if run_steps_done(dump) == steps:  # this job is finished: check it, then start the job again
            problems += finish(dump, reference, args.ngpu, flags, steps)
            rounds += 1
            dump = args.workdir / f"chaos-{rounds}"
        result = run_trial(
            dump, scenarios[(offset + trial) % len(scenarios)], steps, interval, rng, args.ngpu, flags
        )
        trials.append(result)
        print(f"trial {trial + 1}: {json.dumps(result)}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"trials": trials, "mismatches": problems}, indent=2))
    problems += finish(dump, reference, args.ngpu, flags, steps)
    summary = {
        "trials": len(trials),
        "stopped_by_time_limit": timed_out,
        "jobs_finished": rounds,
        "sigterm": sum(t["scenario"] == "sigterm" and t["signalled"] for t in trials),
        "sigterm_saves": sum(t["scenario"] == "sigterm" and t["status"] == EXIT_PREEMPTED for t in trials),
        "sigkill": sum(t["scenario"] != "sigterm" and t["signalled"] for t in trials),
        "kills_during_save": sum(t["signalled"] and t["during_save"] for t in trials),
        "kills_during_purge": sum(t["signalled"] and t["during_purge"] for t in trials),
        "steps_lost_after_sigterm": sum(t.get("steps_lost", 0) for t in trials),
        "trial_problems": sum(len(t["problems"]) for t in trials),
        "mismatches": len(problems),
        "seconds": round(time.time() - start),
    }
    print("summary: " + json.dumps(summary))
    for problem in problems[:20] + [p for t in trials for p in t["problems"]]:
        print(f"  {problem}")
    if args.json:
        args.json.write_text(
            json.dumps({"summary": summary, "trials": trials, "mismatches": problems}, indent=2)
        )
    bad = summary["mismatches"] or summary["steps_lost_after_sigterm"] or summary["trial_problems"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
