"""One run per dump folder: ``<dump_folder>/flame.lock`` names the run that holds it (host, pid, start time).

train.sh takes the lock in its pre-flight (``flame.launch``), before torchrun or any rank writes into the folder,
for its own pid, and removes it when it exits; it passes the lock's path to the ranks in ``FLAME_DUMP_LOCK``. A run
started another way (torchrun directly, tests) takes it on rank 0 when the trainer starts. A second run on the
same folder stops with one line naming the holder. A lock whose holder is a dead process on this host is stale
(a run that was killed): it is taken over with a warning. A lock from another host cannot be checked from here:
the message says to delete it if that run is gone.
"""

import json
import logging
import os
import socket
import time
from pathlib import Path

from flame.errors import FlameError

LOCK_FILE = "flame.lock"
HELD_BY_LAUNCHER = "FLAME_DUMP_LOCK"  # set by train.sh to the lock file it holds for its ranks

logger = logging.getLogger(__name__)


class DumpFolderInUse(FlameError):
    """Another run holds the dump folder's lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class DumpFolderLock:
    def __init__(self, dump_folder: str | os.PathLike, pid: int | None = None):
        self.path = Path(dump_folder) / LOCK_FILE
        self.pid = os.getpid() if pid is None else pid
        self.host = socket.gethostname()

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}  # being written by its holder this instant, or garbage: not ours to judge as stale

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        info = {"host": self.host, "pid": self.pid, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released in between: try again
                self._take_over_or_refuse(holder)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(info) + "\n")
            return

    def _take_over_or_refuse(self, holder: dict) -> None:
        pid, host = holder.get("pid"), holder.get("host")
        ours = host == self.host and pid == self.pid
        stale = host == self.host and isinstance(pid, int) and not _alive(pid)
        if not (ours or stale):
            who = f"pid {pid} on {host}, started {holder.get('started')}" if holder else "an unreadable lock"
            raise DumpFolderInUse(
                f"{self.path.parent} is in use by another run ({who}); give this run another --job.dump_folder, "
                f"or delete {self.path} if that run is gone"
            )
        # Renaming away is atomic: of two runs taking over the same stale lock, one wins the rename.
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{self.pid}")
        try:
            self.path.rename(aside)
        except FileNotFoundError:
            return
        aside.unlink()
        if stale:
            logger.warning(
                f"Took over {self.path} from pid {pid} (no longer running; its run was interrupted)"
            )

    def release(self) -> None:
        holder = self._holder()
        if holder and holder.get("host") == self.host and holder.get("pid") == self.pid:
            self.path.unlink(missing_ok=True)


def hold_for_trainer(dump_folder: str) -> DumpFolderLock | None:
    """The lock for a trainer's ranks: None if train.sh holds it, else taken by rank 0 (every rank raises
    ``DumpFolderInUse`` if that fails)."""
    import torch.distributed as dist

    lock = DumpFolderLock(dump_folder)
    if os.environ.get(HELD_BY_LAUNCHER) == str(lock.path.resolve()):
        return None
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    error = None
    if not distributed or dist.get_rank() == 0:
        try:
            lock.acquire()
        except DumpFolderInUse as e:
            error = str(e)
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise DumpFolderInUse(error)
    return lock if not distributed or dist.get_rank() == 0 else None
