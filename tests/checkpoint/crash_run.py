"""``torchrun ... -m tests.checkpoint.crash_run <flame.train flags>``: flame's trainer, killed at a controlled point.

FLAME_TEST_KILL="<when>:<step>" makes the coordinating rank SIGKILL itself while saving checkpoint step-<step>:
- ``before_metadata``: every rank has written its data files, ``.metadata`` is not written yet (a save cut short);
- ``after_save``: right after ``.metadata`` was written (the run stops between steps, its checkpoint complete).
torchrun then tears down the other ranks, as after a node failure.

FLAME_TEST_SIGNAL="<rank>:<step>" makes that rank alone send itself SIGUSR1 during that step (a preemption signal
that reached one rank).
"""

import os
import signal
import sys

from torch.distributed.checkpoint.filesystem import FileSystemWriter


def _install(spec: str) -> None:
    when, step = spec.split(":")
    original = FileSystemWriter.finish

    def finish(self, metadata, results):
        # flame writes step-<N> under the name step-<N>.partial until it is complete
        target = os.path.basename(os.path.normpath(str(self.path))).removesuffix(".partial") == f"step-{step}"
        if target and when == "before_metadata":
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, metadata, results)
        if target and when == "after_save":
            os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.finish = finish


def _signal_one_rank(spec: str) -> None:
    import torch.distributed as dist

    from flame.train import Trainer

    rank, step = map(int, spec.split(":"))
    original = Trainer.train_step

    def train_step(self, data_iterator):
        if self.step == step and dist.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        original(self, data_iterator)

    Trainer.train_step = train_step


if __name__ == "__main__":
    if "FLAME_TEST_KILL" in os.environ:
        _install(os.environ["FLAME_TEST_KILL"])
    if "FLAME_TEST_SIGNAL" in os.environ:
        _signal_one_rank(os.environ["FLAME_TEST_SIGNAL"])
    from flame.train import main

    sys.exit(main())
