"""torchtitan's CheckpointManager with flame's guarantees around interrupted saves and mismatched checkpoints.

What torchtitan 0.2.2 already does, and flame keeps: DCP checkpoints every ``checkpoint.interval`` steps in
``<dump>/checkpoint/step-<N>``, ``keep_latest_k``, ``load_step`` (-1: latest), the async modes, a model-only
(optionally down-cast) save at the last step, step 0 loaded as model only.

What this subclass changes, each for an upstream behaviour that can lose or corrupt a run:

- "latest" is the highest ``step-<N>`` directory (exact name) that holds ``.metadata``; torchtitan searches the
  name anywhere in the directory name.
- A checkpoint is written into ``step-<N>.partial`` and renamed to ``step-<N>`` when complete (after ``.metadata``
  and ``manifest.json``, the size and SHA-256 of every file); a save into an existing step replaces the old
  directory only at that rename, so a crash in between leaves the old one loadable.
- ``keep_latest_k`` counts complete checkpoints only (torchtitan counts every step directory, so interrupted
  saves could push the last good checkpoint out); interrupted saves older than the newest complete one are deleted.
  A checkpoint is renamed ``step-<N>.purging`` before it is deleted, so a purge cut short leaves no ``step-<N>``
  with files missing.
- Loading verifies the checkpoint first (``flame.checkpoint.verify``): ``load_step`` -1 falls back to the newest
  checkpoint that verifies, naming each one it skipped; a named step that does not verify stops with one line.
- Loading a missing, interrupted or model-only step, a checkpoint of another model (names, shapes) or of a format
  this flame does not read stops with one line (``CheckpointError``) instead of a traceback per rank; an explicit
  ``load_step`` with no checkpoint folder is an error instead of a silent fresh start. Differing config fields with
  equal shapes give a warning.
- Non-tensor entries (step counters, dataloader positions ...) are loaded with ``torch.load(weights_only=True)``:
  plain data only, no pickled code from the checkpoint runs (DCP's own ``.metadata`` is still a pickle).
- ``flame.json`` (model config, tokenizer, flame's version, format number) is written into every step directory
  before the data.
- ``save_now`` writes a full checkpoint at any step and waits until it is complete (used on preemption).
- With a ``HubUploader`` (rank 0, ``checkpoint.hf_upload_enabled``), every checkpoint is handed to it once complete.
- A save whose model parameters hold NaN or inf (a diverged run without ``training.skip_nan_inf``) stops the run
  with one line instead: torchtitan would write them, and ``keep_latest_k`` would then delete the checkpoints from
  before the divergence.
"""

import io
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import MODEL
from torchtitan.components.checkpoint import CheckpointManager as TorchTitanCheckpointManager
from torchtitan.tools.logging import logger

from flame import __version__
from flame.checkpoint.dcp_io import check_model_matches, is_model_only, read_metadata
from flame.checkpoint.hf_on_save import ExportOnSave
from flame.checkpoint.hub_upload import HubUploader
from flame.checkpoint.layout import (
    FORMAT,
    PURGING_SUFFIX,
    CheckpointError,
    config_differences,
    describe_steps,
    latest_step,
    list_steps,
    partial_dir,
    read_sidecar,
    resolve_step_dir,
    step_dir,
    write_sidecar,
)
from flame.checkpoint.verify import checkpoint_problem, write_manifest
from flame.models.layers.sharding import local_tensor

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


def _from_rank0(value):
    """Rank 0's value on every rank (rank 0 alone reads the disk where every rank must decide alike)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _newest_checkpoint_bytes(folder: Path) -> int | None:
    complete = sorted(step for step, ok in list_steps(folder).items() if ok)
    if not complete:
        return None
    return sum(f.stat().st_size for f in step_dir(folder, complete[-1]).iterdir() if f.is_file())


def _non_finite_parameters(modules: list[torch.nn.Module]) -> tuple[int, list[str]]:
    """(The most parameters that hold NaN or inf on one rank, the names of those on this rank): one host sync here
    and one collective, whatever the number of parameters (the ranks of a pipeline hold different ones)."""
    named = [
        (name, local_tensor(parameter)) for module in modules for name, parameter in module.named_parameters()
    ]
    named = [(name, tensor) for name, tensor in named if tensor.is_floating_point() and tensor.numel()]
    if not named:
        return 0, []
    finite = torch.stack([torch.isfinite(tensor).all() for _, tensor in named]).cpu()
    local = [name for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]
    count = torch.tensor([len(local)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        count = count.to(_collective_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item()), local


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in a (nested) state dict held by this rank (a DTensor's local shard)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, Stateful):
        return _tensor_bytes(value.state_dict())
    return 0


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``weights_only=True``: containers, numbers, strings and
    tensors load, anything that would run code (a pickled object of an arbitrary class) is refused."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class CheckpointManager(TorchTitanCheckpointManager):
    def __init__(
        self,
        *args,
        model_config: dict | None = None,
        tokenizer: str | None = None,
        verify_checksums: bool = True,
        hub_uploader: HubUploader | None = None,
        hf_exporter: ExportOnSave | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.model_config = model_config
        self.tokenizer = tokenizer
        if self.enable:
            logger.info(retention_policy(self.folder, self.interval, self.keep_latest_k))
        self.verify_checksums = verify_checksums
        self.hub_uploader = hub_uploader
        self.hf_exporter = hf_exporter
        self._loading = None  # the metadata of the checkpoint being loaded
        self._saving_step: int | None = None  # the save in progress writes into step-<N>.partial
        self._unfinished_step: int | None = None  # written (or being written) but not yet renamed to step-<N>
        self._last_saved_step: int | None = None
        self._forced = False

    # ---- saving -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def save(self, curr_step: int, last_step: bool = False) -> None:
        self._finish_if_written()
        if not self._should_save(curr_step, last_step) or self.enable_ft_dataloader_checkpoints:
            super().save(curr_step, last_step)
            return
        self.wait_for_save()  # a save still in flight finishes before the next one starts
        self._check_parameters_finite(curr_step)
        if not self._room_for_save(curr_step):
            return
        self._prepare_step_dir(curr_step)
        self._saving_step = curr_step
        try:
            super().save(curr_step, last_step)
        except (OSError, CheckpointException) as e:
            if "No space left on device" not in str(e):
                raise
            raise CheckpointError(
                f"the disk of {self.folder} filled up while saving step-{curr_step}; that save stays "
                f"{partial_dir(self.folder, curr_step).name} and is never loaded, the earlier checkpoints are intact: "
                "free some space and resume"
            ) from e
        finally:
            self._saving_step = None
        self._unfinished_step = self._last_saved_step = curr_step
        self._finish_if_written()

    def save_now(self, step: int) -> bool:
        """A full checkpoint of this step, whatever the interval, complete on disk when this returns (a save of
        this step that the loop already started is waited for instead); False if it could not be saved."""
        if self._last_saved_step != step:
            self._forced = True
            try:
                self.save(step)
            finally:
                self._forced = False
        self.wait_for_save()
        return self._last_saved_step == step

    def wait_for_save(self) -> None:
        """Wait for an async save in flight and finish it (the rename to ``step-<N>``)."""
        self._async_wait()
        self._finish_if_written()

    def due(self, step: int, last_step: bool = False) -> bool:
        """``save(step, last_step)`` will write a checkpoint."""
        return self._should_save(step, last_step)

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return (self._forced and self.enable and not self.load_only) or super()._should_save(
            curr_step, last_step
        )

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        if not folder and step == self._saving_step:
            return str(partial_dir(self.folder, step))
        return super()._create_checkpoint_id(step, folder)

    def _check_parameters_finite(self, step: int) -> None:
        if MODEL not in self.states:
            return
        count, names = _non_finite_parameters(self.states[MODEL].model)
        if count:
            shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "") if names else "on other ranks"
            newest = latest_step(self.folder)
            again = (
                f"step-{newest} is the newest checkpoint: resume from it"
                if newest >= 0
                else "no checkpoint was saved before it: start again"
            )
            raise CheckpointError(
                f"the model's parameters hold NaN or inf at step {step} ({count} on a rank: {shown}), so step-{step} "
                f"is not saved and the run stops; {again} with a lower learning rate, or train with "
                "--training.skip_nan_inf (steps with a non-finite gradient norm leave the parameters as they were)"
            )

    def _room_for_save(self, step: int) -> bool:
        """Whether the checkpoint folder's disk has room for a checkpoint (as large as the newest one, or as the
        tensors of every rank if there is none yet); if not, the save is skipped with one line and the run goes
        on, its state in memory, the checkpoints on disk untouched: the next save tries again."""
        folder = Path(self.folder)
        # Rank 0 looks at the disk for all: an async save's rename on rank 0 can come after another rank looks.
        needed = _from_rank0(_newest_checkpoint_bytes(folder) if _rank() == 0 else None)
        if needed is None:
            local = torch.tensor([_tensor_bytes(self._flattened_model_states_sd())], dtype=torch.float64)
            if dist.is_initialized() and dist.get_world_size() > 1:
                local = local.to(_collective_device())
                dist.all_reduce(local)
            needed = int(local.item())
        if _rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(folder).free
            problem = None if free > needed * 1.05 else (needed, free)
        else:
            problem = None
        problem = _from_rank0(problem)
        if problem:
            needed, free = problem
            logger.error(
                f"Not saving checkpoint step-{step}: it needs about {needed / 2**30:.2f} GiB and {folder} has "
                f"{free / 2**30:.2f} GiB free; free some space (or lower --checkpoint.keep_latest_k): the run goes "
                "on and the next save tries again"
            )
        return problem is None

    def _prepare_step_dir(self, step: int) -> None:
        path = partial_dir(self.folder, step)
        if _rank() == 0:
            if path.exists():  # an earlier save of this step that was cut short
                shutil.rmtree(path)
            path.mkdir(parents=True)
            if self.model_config is not None:
                write_sidecar(path, self.model_config, self.tokenizer)
        _barrier()

    def _finish_if_written(self) -> None:
        """Once the save of ``_unfinished_step`` is on disk: its manifest, then the rename to ``step-<N>``."""
        step = self._unfinished_step
        if step is None or (self.save_future is not None and not self.save_future.done()):
            return
        if self.save_future is not None:
            self.save_future.result()  # an async save that failed raises here, before it could count
        self._unfinished_step = None
        if _rank() != 0:
            return
        written, final = partial_dir(self.folder, step), step_dir(self.folder, step)
        write_manifest(written)
        if final.exists():
            logger.info(f"Replacing the checkpoint {final} saved by an earlier run")
            self._purge(final)
        written.rename(final)
        if self.hub_uploader is not None:  # staged before a later purge can delete it
            self.hub_uploader.submit(step, final)
        if self.hf_exporter is not None:
            self.hf_exporter.submit(step, final)
        self._purge_stale_checkpoints()

    def _purge(self, path: Path) -> None:
        """Delete a step directory in the background, renamed first so that it never looks like a checkpoint."""
        doomed = path.with_name(path.name + PURGING_SUFFIX)
        if doomed.exists():  # an earlier purge of this name that was cut short
            shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
        if self.purge_thread is None:  # keep_latest_k 0: torchtitan starts no purge thread
            shutil.rmtree(doomed)
        else:
            self.purge_queue.put(str(doomed))

    def _purge_stale_checkpoints(self) -> None:
        # torchtitan calls this right after a save starts; flame purges once a save is finished (renamed).
        in_flight = self._saving_step is not None or self._unfinished_step is not None
        if in_flight or _rank() != 0 or not os.path.isdir(self.folder):
            return
        folder = Path(self.folder)
        if self.keep_latest_k <= 0:
            return
        for leftover in folder.glob(f"step-*{PURGING_SUFFIX}"):  # a purge cut short by a crash
            self.purge_queue.put(str(leftover))
        steps = list_steps(folder)
        complete = sorted(step for step, ok in steps.items() if ok)
        if not complete:
            return
        # Interrupted saves older than the newest complete checkpoint are debris (no save is in flight here).
        debris = [step for step, ok in steps.items() if not ok and step < complete[-1]]
        for step in complete[: -self.keep_latest_k] + debris:
            for path in (step_dir(folder, step), partial_dir(folder, step)):
                if path.is_dir():
                    self._purge(path)

    def close(self) -> None:
        if getattr(self, "_unfinished_step", None) is not None:
            self.wait_for_save()
        super().close()

    # ---- loading ------------------------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        return self._newest_verified_step(Path(folder or self.folder))

    def _newest_verified_step(self, folder: Path) -> int:
        """The newest complete checkpoint that verifies (-1: none is complete); the ones skipped are named."""
        answer = None
        if _rank() == 0:  # rank 0 reads the disk and decides for all
            problems, chosen = [], None
            for step in sorted((step for step, ok in list_steps(folder).items() if ok), reverse=True):
                problem = checkpoint_problem(step_dir(folder, step), self.verify_checksums)
                if problem is None:
                    chosen = step
                    break
                problems.append(f"step-{step}: {problem}")
                logger.warning(f"Skipping checkpoint {step_dir(folder, step)}: {problem}")
            answer = (chosen, problems)
        step, problems = _from_rank0(answer)
        if problems and step is None:
            raise CheckpointError(f"no checkpoint in {folder} verifies ({'; '.join(problems)})")
        return -1 if step is None else step

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
        if step == -1:
            step = self._find_load_step()
            if step == -1:
                if list_steps(self.folder):
                    logger.warning(f"No complete checkpoint in {self.folder} ({describe_steps(self.folder)})")
                return False
            path = step_dir(self.folder, step)
        else:
            path = resolve_step_dir(self.folder, step)
            step = int(path.name.removeprefix("step-"))
            problem = _from_rank0(checkpoint_problem(path, self.verify_checksums) if _rank() == 0 else None)
            if problem:
                raise CheckpointError(
                    f"checkpoint {path} is damaged: {problem}; load another step ({describe_steps(self.folder)}) "
                    "or -1 for the newest one that verifies"
                )
        sidecar = read_sidecar(path)
        self._check_format(path, sidecar)
        metadata = read_metadata(path)
        if step != 0 and is_model_only(metadata):
            raise CheckpointError(
                f"checkpoint {path} holds only the model (a seed checkpoint or checkpoint.last_save_model_only) "
                "and cannot resume training; convert it (python -m flame.cli.convert_dcp_to_hf) or start a new "
                "run from it"
            )
        expected = {k: tuple(v.shape) for k, v in self.states["model"].state_dict().items()}
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A pipeline stage holds part of the model: the ranks together must match the checkpoint.
            shards = [None] * dist.get_world_size()
            dist.all_gather_object(shards, expected)
            expected = {k: v for shard in shards for k, v in shard.items()}
        check_model_matches(metadata, expected, f"checkpoint {path}")
        if sidecar and self.model_config is not None:
            differences = config_differences(sidecar["model_config"], self.model_config)
            if differences:
                logger.warning(f"The model config differs from the one checkpoint {path} was saved with: "
                               + "; ".join(differences))  # fmt: skip
        self._loading = metadata
        try:
            return super().load(step)
        finally:
            self._loading = None

    @staticmethod
    def _check_format(path: Path, sidecar: dict | None) -> None:
        """A full checkpoint of another format stops here (a model-only one holds tensors alone, which every
        format stores alike)."""
        if sidecar is None:
            return
        written = sidecar.get("format", 0)
        if written == FORMAT:
            return
        by = f"flame {sidecar['flame_version']}" if "flame_version" in sidecar else "a flame before 0.1.0"
        if written > FORMAT:
            raise CheckpointError(
                f"checkpoint {path} has format {written} (written by {by}); this flame {__version__} reads format "
                f"{FORMAT}: update flame to resume it"
            )
        if not is_model_only(read_metadata(path)):
            raise CheckpointError(
                f"checkpoint {path} has format {written} (written by {by}; its RNG and dataloader state are "
                f"pickled), this flame {__version__} reads format {FORMAT}: start a new run from its weights with "
                f"--checkpoint.initial_load_path {path} --checkpoint.initial_load_model_only"
            )

    def dcp_load(self, state_dict: dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=PlainDataLoadPlanner())
        if MODEL in self.states:  # the model's entries are flattened into state_dict (as torchtitan does)
            self.states[MODEL].load_state_dict(state_dict)

    def _states_to_load(self, model_only: bool) -> dict:
        states = super()._states_to_load(model_only)
        if self._loading is None:
            return states
        saved = self._loading.state_dict_metadata
        for key in OPTIONAL_STATES:
            if key in states and not any(name.split(".", 1)[0] == key for name in saved):
                logger.warning(f"The checkpoint has no '{key}' state; it keeps its current value")
                states.pop(key)
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if "rng" in states and saved["rng.torch"].size[0] != world_size:
            logger.warning(
                f"The checkpoint holds RNG states of {saved['rng.torch'].size[0]} ranks, this run has {world_size}: "
                "the random generators keep their seeded state"
            )
            states.pop("rng")
        return states
