"""flame.process_end: a process leaves as Python's exit would, without the final garbage collection."""

import subprocess
import sys


def test_a_process_ends_as_pythons_exit_does_without_the_final_collection(tmp_path):
    """A rank's end (flame/train/__main__.py) and the pre-flight's (flame/launch.py) join non-daemon threads (a
    thread-pool executor's after stopping them), run the atexit handlers and flush the streams before they leave
    with the status given."""
    script = f"""
import atexit, threading, time
from pathlib import Path
from flame.process_end import exit_without_final_collection
folder = Path({str(tmp_path)!r})
def late_write():
    time.sleep(0.3)
    (folder / "thread").write_text("done")
threading.Thread(target=late_write).start()
# An executor left running: Python's exit stops its worker threads before joining them.
from concurrent.futures import ThreadPoolExecutor
ThreadPoolExecutor(1).submit(lambda: None).result()
atexit.register(lambda: (folder / "atexit").write_text("done"))
print("unflushed", end="")
exit_without_final_collection(3)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3 and result.stdout == "unflushed", result.stderr
    assert (tmp_path / "thread").read_text() == (tmp_path / "atexit").read_text() == "done"
