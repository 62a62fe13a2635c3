"""torchtitan's CheckpointManager with flame's guarantees around interrupted saves and mismatched checkpoints.

What torchtitan 0.2.2 already does, and flame keeps: DCP checkpoints every ``checkpoint.interval`` steps in
``<dump>/checkpoint/step-<N>``, ``keep_latest_k``, ``load_step`` (-1: latest), the async modes, a model-only
(optionally down-cast) save at the last step, step 0 loaded as model only.

What this subclass changes, each for an upstream behaviour that can lose or corrupt a run:

- "latest" is the highest ``step-<N>`` directory (exact name) that holds ``.metadata``; torchtitan searches the
  name anywhere in the directory name.
- A save into an existing step directory (a resumed run reaching a step that an earlier run also saved) first
  removes it: DCP replaces ``.metadata`` only at the end, so a crash in between would leave the old metadata over
  new data files, a directory that looks complete.
- ``keep_latest_k`` counts complete checkpoints only (torchtitan counts every step directory, so interrupted
  saves could push the last good checkpoint out); interrupted saves older than the newest complete one are deleted.
- Loading a missing, interrupted or model-only step, or a checkpoint of another model (names, shapes), stops with
  one line (``CheckpointError``) instead of a traceback per rank; an explicit ``load_step`` with no checkpoint
  folder is an error instead of a silent fresh start. Differing config fields with equal shapes give a warning.
- ``flame.json`` (model config, tokenizer) is written into every step directory before the data.
"""

import os
import shutil

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager as TorchTitanCheckpointManager
from torchtitan.tools.logging import logger

from flame.checkpoint.dcp_io import check_model_matches, is_model_only, read_metadata
from flame.checkpoint.layout import (
    CheckpointError,
    config_differences,
    describe_steps,
    latest_step,
    list_steps,
    read_sidecar,
    resolve_step_dir,
    step_dir,
    write_sidecar,
)

# Entries of the states dict that older checkpoints may lack: loaded only when the checkpoint has them.
OPTIONAL_STATES = ("rng",)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def retention_policy(folder: str, interval: int, keep_latest_k: int) -> str:
    """The start banner's line on checkpoint retention (upstream flame's default keeps every checkpoint)."""
    kept = "keeping all of them" if keep_latest_k <= 0 else f"keeping the latest {keep_latest_k}"
    return (
        f"Checkpoints every {interval} steps in {folder}, {kept} (checkpoint.keep_latest_k {keep_latest_k})"
    )


class CheckpointManager(TorchTitanCheckpointManager):
    def __init__(self, *args, model_config: dict | None = None, tokenizer: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self._loading_keys: set[str] | None = None
        if self.enable:
            logger.info(retention_policy(self.folder, self.interval, self.keep_latest_k))

    # ---- saving -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def save(self, curr_step: int, last_step: bool = False) -> None:
        if self._should_save(curr_step, last_step) and not self.enable_ft_dataloader_checkpoints:
            self._async_wait()  # a save still in flight finishes before its directory could be touched
            self._prepare_step_dir(curr_step)
        super().save(curr_step, last_step)
        if last_step and self._should_save(curr_step, last_step):
            self._purge_stale_checkpoints()  # torchtitan purges after interval saves only

    def _prepare_step_dir(self, step: int) -> None:
        path = step_dir(self.folder, step)
        if _rank() == 0:
            if path.exists():
                logger.info(f"Replacing the checkpoint {path} saved by an earlier run")
                shutil.rmtree(path)
            path.mkdir(parents=True)
            if self.model_config is not None:
                write_sidecar(path, self.model_config, self.tokenizer)
        _barrier()

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k <= 0 or _rank() != 0 or not os.path.isdir(self.folder):
            return
        steps = list_steps(self.folder)
        complete = sorted(step for step, ok in steps.items() if ok)
        if not complete:
            return
        # Interrupted saves older than the newest complete checkpoint are debris; a newer one is in flight.
        debris = [step for step, ok in steps.items() if not ok and step < complete[-1]]
        for step in complete[: -self.keep_latest_k] + debris:
            self.purge_queue.put(str(step_dir(self.folder, step)))

    # ---- loading ------------------------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        return latest_step(folder or self.folder)

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        if not self.enable:
            return False
        if not os.path.exists(self.folder):
            if step not in (-1, 0) and not self.initial_load_path:
                raise CheckpointError(
                    f"--checkpoint.load_step {step} but there is no checkpoint folder {self.folder}"
                )
            return super().load(step)
        if step == -1 and latest_step(self.folder) == -1:
            if list_steps(self.folder):
                logger.warning(f"No complete checkpoint in {self.folder} ({describe_steps(self.folder)})")
            return False
        path = resolve_step_dir(self.folder, step)
        step = int(path.name.removeprefix("step-"))
        metadata = read_metadata(path)
        if step != 0 and is_model_only(metadata):
            raise CheckpointError(
                f"checkpoint {path} holds only the model (a seed checkpoint or checkpoint.last_save_model_only) "
                "and cannot resume training; convert it (python -m flame.utils.convert_dcp_to_hf) or start a new "
                "run from it"
            )
        expected = {k: tuple(v.shape) for k, v in self.states["model"].state_dict().items()}
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A pipeline stage holds part of the model: the ranks together must match the checkpoint.
            shards = [None] * dist.get_world_size()
            dist.all_gather_object(shards, expected)
            expected = {k: v for shard in shards for k, v in shard.items()}
        check_model_matches(metadata, expected, f"checkpoint {path}")
        sidecar = read_sidecar(path)
        if sidecar and self.model_config is not None:
            differences = config_differences(sidecar["model_config"], self.model_config)
            if differences:
                logger.warning(f"The model config differs from the one checkpoint {path} was saved with: "
                               + "; ".join(differences))  # fmt: skip
        self._loading_keys = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
        try:
            return super().load(step)
        finally:
            self._loading_keys = None

    def _states_to_load(self, model_only: bool) -> dict:
        states = super()._states_to_load(model_only)
        if self._loading_keys is not None:
            for key in OPTIONAL_STATES:
                if key in states and key not in self._loading_keys:
                    logger.warning(f"The checkpoint has no '{key}' state; it keeps its current value")
                    states.pop(key)
        return states
