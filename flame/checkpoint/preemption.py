"""Preemption: a signal (SIGTERM, SIGUSR1 by default: ``checkpoint.preempt_signals``) makes every rank finish the
step it is in, save a full checkpoint and exit with ``EXIT_PREEMPTED``; the next launch resumes from it exactly.

Clusters send such a signal before they kill a job (SLURM's ``--signal=USR1@120`` or its SIGTERM at the time limit,
Kubernetes and spot instances SIGTERM). The handler only records the signal; after each step the ranks agree
(one all-reduce of a host tensor over gloo) whether any of them got one, so all of them save the same step together. A second signal, or
``checkpoint.preempt_timeout`` seconds after the first, ends the process at once without the save
(``EXIT_PREEMPTED_UNSAVED``). The same signal arriving twice within ``DUPLICATE_WINDOW`` seconds counts once: a
launcher that forwards it and a scheduler that signals every process of the job deliver it twice.

Rank 0 writes ``<dump_folder>/preempted.json`` once the checkpoint is complete, so that train.sh, which sees only
torchrun's status, can exit with ``EXIT_PREEMPTED`` too.
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from flame.errors import ConfigError

EXIT_PREEMPTED = 75  # a checkpoint of the step in progress was saved: launch again to resume (EX_TEMPFAIL)
EXIT_PREEMPTED_UNSAVED = 76  # stopped by a second signal or the timeout: resumes from the previous checkpoint
MARKER = "preempted.json"
DUPLICATE_WINDOW = 2.0


class Preempted(Exception):
    """Raised out of the training loop after the preemption checkpoint is saved."""

    def __init__(self, step: int, signal_name: str, saved: bool):
        super().__init__(f"preempted by {signal_name} at step {step}")
        self.step = step
        self.signal_name = signal_name
        self.exit_status = EXIT_PREEMPTED if saved else EXIT_PREEMPTED_UNSAVED


def parse_signals(names: list[str]) -> list[signal.Signals]:
    parsed = []
    for name in filter(None, (name.strip() for name in names)):  # "--checkpoint.preempt_signals ''": none
        canonical = name.upper()
        canonical = canonical if canonical.startswith("SIG") else "SIG" + canonical
        if canonical in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, canonical):
            raise ConfigError(
                f"checkpoint.preempt_signals: {name!r} is not a signal a process can catch; "
                "use names such as SIGTERM,SIGUSR1"
            )
        parsed.append(signal.Signals[canonical])
    return parsed


def _say(text: str) -> None:
    # Inside a signal handler: a plain write, no logging locks that the interrupted code might hold.
    os.write(2, (text + "\n").encode())


class Preemption:
    def __init__(self, signal_names: list[str], timeout: float, dump_folder: str):
        self.signals = parse_signals(signal_names)
        self.timeout = timeout
        # The vote's group: one that takes host tensors (creating it is a collective: every rank builds a Preemption).
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1 and "gloo" not in dist.get_backend():
            self._group = dist.new_group(backend="gloo")
        self.marker = Path(dump_folder) / MARKER
        self.received: signal.Signals | None = None
        self._first_at = 0.0
        self._pid = os.getpid()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        if self._rank() == 0:
            self.marker.unlink(missing_ok=True)  # left by an earlier preempted launch

    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a forked dataloader worker inherited the handler: the trainer decides
            return
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signal.Signals(signum), now
            _say(f"[flame] {self.received.name}: finishing this step, then saving a checkpoint and exiting")
            if self.timeout > 0:
                timer = threading.Timer(self.timeout, self._give_up, args=(f"{self.timeout:g} s passed",))
                timer.daemon = True
                timer.start()
        elif now - self._first_at > DUPLICATE_WINDOW:
            self._give_up(f"a second {signal.Signals(signum).name}")

    @staticmethod
    def _give_up(reason: str) -> None:
        _say(f"[flame] {reason} after the preemption signal: exiting without saving")
        os._exit(EXIT_PREEMPTED_UNSAVED)

    def close(self) -> None:
        """Give the signals back to the handlers they had before (a process that goes on after the trainer)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self) -> bool:
        """Whether any rank got a preemption signal (the same answer on every rank)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received is not None
        # On the host, over gloo: a flag on the GPU would make every step wait for its kernels before the next one
        # is launched (reading it back is a device sync); the CPU all-reduce costs the ranks' hosts microseconds.
        flag = torch.tensor([0 if self.received is None else int(self.received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if self.received is None and flag.item():
            self.received = signal.Signals(int(flag.item()))  # another rank's signal
        return bool(flag.item())

    def save_and_stop(self, checkpointer, step: int) -> None:
        """Save a full checkpoint of ``step``, record it for the launcher and raise ``Preempted``."""
        name = self.received.name
        if not checkpointer.enable:
            logger.warning(f"Preempted by {name} after step {step}; checkpoints are off, nothing is saved")
            raise Preempted(step, name, saved=False)
        logger.warning(f"Preempted by {name} after step {step}: saving a checkpoint")
        if not checkpointer.save_now(step):  # no room on the disk (said in one line)
            raise Preempted(step, name, saved=False)
        if self._rank() == 0:
            self.marker.write_text(json.dumps({"step": step, "signal": name}) + "\n")
        logger.warning(f"Saved checkpoint step-{step}; exiting with status {EXIT_PREEMPTED}")
        raise Preempted(step, name, saved=True)
