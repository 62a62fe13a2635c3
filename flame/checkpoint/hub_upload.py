"""Uploading a run's checkpoints to one hub repository in the background (``--checkpoint.hf_upload_enabled``).

The flags are the softpick fork's (zaydzuhri/flame): each saved checkpoint becomes a ``step-<N>/`` folder of a hub
repository, as the DCP folder (``hf_upload_format dcp``) or as an HF export of it (``hf``). The fork uploads
synchronously on rank 0 into a new timestamped repository per launch; here:

- the repository is ``checkpoint.hf_repo_base_name`` itself, created if missing, so that a resumed run adds to it;
- rank 0 hands a complete checkpoint (renamed from ``.partial``, manifest written) to a thread and trains on: the
  checkpoint's files are hard-linked into ``<checkpoint folder>/hub-upload/<time>/step-<N>/`` first, so that local
  retention may delete the checkpoint while its upload waits; checkpoints saved during an upload queue behind it;
- each step is one commit, which also deletes the hub's step folders beyond ``checkpoint.keep_latest_k``: the hub
  holds a step whole or not at all, and prunes only when an upload succeeded; a queued step that keep_latest_k newer
  queued steps would prune is not uploaded;
- a failed upload (offline, no token, rate limit, HTTP error) is one warning line; training goes on;
- the end of the run waits ``checkpoint.hf_upload_timeout`` seconds for the queue (not at all after a preemption
  signal); what is left stays staged and is uploaded first by the next launch of the run.
"""

import logging
import os
import queue
import re
import shutil
import threading
import time
from pathlib import Path

from torchtitan.tools.logging import logger

from flame.checkpoint.layout import STEP_DIR, link_tree

STAGING = "hub-upload"
LINKING_SUFFIX = ".linking"
STEP_FOLDER = re.compile(r"step-(\d+)/")  # a path in the hub repository


class HubUploader:
    """Uploads complete checkpoints of one run to ``repo`` from a thread; ``submit`` returns at once."""

    def __init__(
        self,
        repo: str,
        checkpoint_folder: str | os.PathLike,
        upload_format: str = "dcp",
        keep_latest_k: int = 0,
        private: bool = False,
        export_dtype: str = "float32",
    ):
        from huggingface_hub import HfApi, get_token

        # httpx logs every request at INFO, which would put a line per upload request into the training log.
        if logging.getLogger("httpx").level == logging.NOTSET:
            logging.getLogger("httpx").setLevel(logging.WARNING)
        # huggingface_hub reads HF_ENDPOINT once, at its import; the run's environment decides here.
        self.api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))
        self.repo = repo
        self.repo_id: str | None = None  # the repository's full name, once it is known to exist
        self.checkpoint_folder = Path(checkpoint_folder)
        self.staging = self.checkpoint_folder / STAGING
        self.upload_format = upload_format
        self.keep_latest_k = keep_latest_k
        self.private = private
        self.export_dtype = export_dtype
        self._secret = get_token()  # never written to the log (see _describe)
        self._queue: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self._pending: list[int] = []  # steps queued or uploading, in order
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="hub-upload", daemon=True)
        self._thread.start()
        left = self._left_by_last_launch()
        if left:
            logger.info(
                f"Uploading {', '.join(f'step-{s}' for s, _ in left)} left pending by the last launch"
            )
            for step, staged in left:
                self._enqueue(step, staged)

    def _left_by_last_launch(self) -> list[tuple[int, Path]]:
        """(step, staged folder) of the uploads an earlier launch did not finish, oldest first."""
        if not self.staging.is_dir():
            return []
        left = []
        for staged in sorted(p for p in self.staging.iterdir() if p.is_dir()):
            if staged.name.endswith(LINKING_SUFFIX):  # cut short while its files were linked
                shutil.rmtree(staged, ignore_errors=True)
                continue
            steps = [int(m.group(1)) for p in staged.iterdir() if (m := STEP_DIR.fullmatch(p.name))]
            left += [(steps[0], staged)] if len(steps) == 1 else []
        return left

    def submit(self, step: int, checkpoint: Path) -> None:
        """Queue the upload of a complete checkpoint (its files are hard-linked first: this takes milliseconds).
        Each submission has its own folder ``hub-upload/<time>/step-<N>``: a step saved again while its earlier
        save waits is uploaded after it, and the later commit wins."""
        staged = self.staging / str(time.time_ns())
        linking = staged.with_name(staged.name + LINKING_SUFFIX)
        link_tree(checkpoint, linking / checkpoint.name)
        linking.rename(staged)  # whole: a launch cut short here leaves a .linking folder, never uploaded
        self._enqueue(step, staged)

    def _enqueue(self, step: int, staged: Path) -> None:
        with self._lock:
            self._pending.append(step)
        self._queue.put((step, staged))

    def pending(self) -> list[int]:
        with self._lock:
            return list(self._pending)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            step, staged = item
            with self._lock:
                newer = [s for s in self._pending if s > step]
            try:
                if 0 < self.keep_latest_k <= len(newer):  # uploads that fall behind catch up
                    logger.info(
                        f"Not uploading checkpoint step-{step}: {', '.join(f'step-{s}' for s in newer)} wait behind "
                        f"it and checkpoint.keep_latest_k {self.keep_latest_k} would remove it from the hub"
                    )
                else:
                    self._upload(step, staged)
            except Exception as e:  # noqa: BLE001 (an exception would end the thread, and every later upload)
                logger.warning(
                    f"Hub upload of checkpoint step-{step} to {self.repo} failed ({self._describe(e)}); "
                    f"training goes on, the checkpoint is kept in {self.checkpoint_folder} as usual"
                )
            shutil.rmtree(staged, ignore_errors=True)
            with self._lock:
                self._pending.remove(step)

    def _describe(self, error: Exception) -> str:
        lines = str(error).strip().splitlines()
        text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        return text.replace(self._secret, "<token>") if self._secret else text

    def _upload(self, step: int, staged: Path) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        started = time.perf_counter()
        if self.repo_id is None:
            # private=None leaves the visibility to the hub (public unless the organization says otherwise), as the
            # fork does.
            url = self.api.create_repo(self.repo, private=True if self.private else None, exist_ok=True)
            self.repo_id = url.repo_id
        folder = staged / f"step-{step}"
        if self.upload_format == "hf":
            from flame.hf.export import export_checkpoint

            folder = staged / "hf"
            export_checkpoint(staged, step, folder, dtype=self.export_dtype)
        prefix = f"step-{step}"
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        additions = [
            CommitOperationAdd(f"{prefix}/{p.relative_to(folder).as_posix()}", str(p)) for p in files
        ]
        added = {op.path_in_repo for op in additions}
        remote = self.api.list_repo_files(self.repo_id)
        # Files of an earlier upload of this step that this one does not have (another shard count, format).
        stale = [path for path in remote if path.startswith(prefix + "/") and path not in added]
        on_hub = {int(m.group(1)) for path in remote if (m := STEP_FOLDER.match(path))} | {step}
        pruned = (
            [s for s in sorted(on_hub)[: -self.keep_latest_k] if s != step] if self.keep_latest_k > 0 else []
        )
        operations = (
            additions
            + [CommitOperationDelete(path) for path in stale]
            + [CommitOperationDelete(f"step-{s}/", is_folder=True) for s in pruned]
        )
        message = f"{prefix} ({self.upload_format})" + (
            f", removing {', '.join(f'step-{s}' for s in pruned)}" if pruned else ""
        )
        self.api.create_commit(self.repo_id, operations, commit_message=message)
        size = sum(p.stat().st_size for p in files)
        removed = (
            f"; removed {', '.join(f'step-{s}' for s in pruned)} from the hub "
            f"(checkpoint.keep_latest_k {self.keep_latest_k})"
            if pruned
            else ""
        )
        logger.info(
            f"Uploaded checkpoint step-{step} ({self.upload_format}, {len(files)} files, {size / 2**20:.1f} MiB) "
            f"to {self.api.endpoint}/{self.repo_id} in {time.perf_counter() - started:.1f} s{removed}"
        )

    def close(self, timeout: float) -> list[int]:
        """Wait up to ``timeout`` seconds for the queued uploads; returns (and names in a warning) the steps still
        pending, which stay staged for the next launch."""
        self._queue.put(None)
        waiting = self.pending()
        if waiting and timeout > 0:
            steps = ", ".join(f"step-{s}" for s in waiting)
            logger.info(
                f"Waiting up to {timeout:g} s for the hub upload of {steps} (checkpoint.hf_upload_timeout)"
            )
        self._thread.join(timeout)
        left = self.pending()
        if not left and self.staging.is_dir() and not any(self.staging.iterdir()):
            self.staging.rmdir()
        if left:
            logger.warning(
                f"Hub upload of {', '.join(f'step-{s}' for s in left)} to {self.repo} still pending after "
                f"{timeout:g} s (checkpoint.hf_upload_timeout); it stays in {self.staging} and the next launch of "
                "this run uploads it"
            )
        return left
