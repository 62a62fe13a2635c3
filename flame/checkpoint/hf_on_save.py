"""HF exports of a run's checkpoints as they are saved (``--checkpoint.convert_to_hf_on_save``, the softpick fork's
flag, which exports each step into its own checkpoint folder on the training thread).

Here rank 0 hands each complete checkpoint to a background thread (its files hard-linked into
``<checkpoint folder>/hf-export/<time>/step-<N>`` first, so that retention may delete the checkpoint meanwhile),
which writes the export into ``step-<N>-hf.partial`` and renames it to ``step-<N>-hf`` once whole: a folder of that
name loads with ``AutoModelForCausalLM.from_pretrained`` (in ``checkpoint.export_dtype``). An export goes with its
checkpoint: after each export, and at the end, the exports whose checkpoint retention (``keep_latest_k``) removed
are deleted. A failed export is one warning line and training goes on. The end of the run waits for the exports
still queued, but for a preempted run.
"""

import queue
import re
import shutil
import threading
import time
from pathlib import Path

from torchtitan.tools.logging import logger

from flame.checkpoint.layout import PARTIAL_SUFFIX, hf_export_dir, link_tree, step_dir
from flame.errors import first_line

STAGING = "hf-export"
EXPORT_DIR = re.compile(r"step-(\d+)-hf")


class ExportOnSave:
    """Exports complete checkpoints of the run in ``folder`` to HF folders beside them; ``submit`` returns at once."""

    def __init__(self, folder: str | Path, export_dtype: str = "float32"):
        self.folder = Path(folder)
        self.staging = self.folder / STAGING
        self.export_dtype = export_dtype
        # What a launch cut short left half-done (its checkpoints are on disk: convert_dcp_to_hf exports them).
        shutil.rmtree(self.staging, ignore_errors=True)
        for partial in self.folder.glob(f"step-*-hf{PARTIAL_SUFFIX}"):
            shutil.rmtree(partial, ignore_errors=True)
        self._queue: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="hf-export", daemon=True)
        self._thread.start()

    def submit(self, step: int, checkpoint: Path) -> None:
        staged = self.staging / str(time.time_ns())
        link_tree(checkpoint, staged / checkpoint.name)
        self._queue.put((step, staged))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            step, staged = item
            try:
                self._export(step, staged)
            except Exception as e:  # noqa: BLE001 (an exception would end the thread, and every later export)
                logger.warning(
                    f"HF export of checkpoint step-{step} failed ({type(e).__name__}: {first_line(e)}); "
                    f"training goes on, the checkpoint is kept; `python -m flame.utils.convert_dcp_to_hf --path "
                    f"{self.folder} --step {step}` exports it later"
                )
            shutil.rmtree(staged, ignore_errors=True)
            self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Delete the exports whose checkpoint is gone (retention removed it)."""
        for export in self.folder.glob("step-*-hf"):
            if (match := EXPORT_DIR.fullmatch(export.name)) and not step_dir(
                self.folder, int(match[1])
            ).is_dir():
                shutil.rmtree(export, ignore_errors=True)

    def _export(self, step: int, staged: Path) -> None:
        from flame.hf.export import export_checkpoint

        started = time.perf_counter()
        target = hf_export_dir(self.folder, step)
        partial = target.with_name(target.name + PARTIAL_SUFFIX)
        shutil.rmtree(partial, ignore_errors=True)
        export_checkpoint(staged, step, partial, dtype=self.export_dtype)
        if target.exists():  # an earlier save of this step
            shutil.rmtree(target)
        partial.rename(target)
        logger.info(f"Exported checkpoint step-{step} to {target} in {time.perf_counter() - started:.1f} s")

    def close(self, wait: bool = True) -> None:
        """Wait for the exports still queued (not after a preemption signal: the checkpoints are saved, and
        convert_dcp_to_hf exports them later)."""
        self._queue.put(None)
        if wait:
            self._thread.join()
            self._remove_orphans()
        if self.staging.is_dir() and not any(self.staging.iterdir()):
            self.staging.rmdir()
