"""How flame's short-lived and training processes end: as Python's exit does, without its last collection."""

import atexit
import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent() -> None:
    """Has the kernel SIGKILL this process when its parent ends, however the parent ends (Linux's parent-death
    signal; elsewhere nothing). Launchers start ranks in sessions of their own, which a signal to the launcher's
    process group misses: this keeps a rank from training on, holding its GPU, after its launcher was killed."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def exit_without_final_collection(status: int) -> None:
    """Ends the process as Python's exit does (threading's shutdown: its exit callbacks, which stop thread-pool
    executors' workers, then the non-daemon threads joined; the atexit handlers: logging's flush, W&B's, dataloader
    workers' shutdown; the standard streams flushed) but without the interpreter's final garbage collection of every
    object the imports made, which takes about a second of a rank's end after torchtitan's imports (2 CPU cores,
    2026-12-04: 1.10 s for ``import flame.train.trainer`` alone, 0.17 s without it) and 0.3 s after torch's alone."""
    # The two steps the interpreter's own finalization takes first (CPython's Py_FinalizeEx), in its order.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
