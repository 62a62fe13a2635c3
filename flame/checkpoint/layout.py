"""Where checkpoints live and which of them are complete (no torch import: the converters' checks stay fast).

A run's checkpoints are torchtitan's: ``<dump_folder>/<checkpoint.folder>/step-<N>/``, each a DCP checkpoint whose
``.metadata`` file the coordinating rank writes last, after every rank's data files. flame writes a checkpoint into
``step-<N>.partial`` and renames it to ``step-<N>`` once ``.metadata`` and the manifest are written, so a directory
named ``step-<N>`` is a finished save. A ``.partial`` directory, or a ``step-<N>`` without ``.metadata`` (written by
flame before the rename existed), is a save that did not finish (killed, out of disk ...): it is never loaded as
"latest", and loading it by number fails with one line. A checkpoint being deleted is renamed ``step-<N>.purging``
first, so a purge cut short never leaves a ``step-<N>`` with files missing.

Next to ``.metadata`` flame writes ``flame.json`` before the data (the model config the weights belong to, the
tokenizer of the run, flame's version and the checkpoint format number) and ``manifest.json`` after it (the size
and SHA-256 of every file), so that converters, resumed runs and ``python -m flame.checkpoint verify`` can check
what they load.
"""

import json
import os
import re
import shutil
from pathlib import Path

from flame import __version__
from flame.errors import FlameError
from flame.models.common.config_json import dumps_config, loads_config

STEP_DIR = re.compile(r"step-(\d+)")
PARTIAL_DIR = re.compile(r"step-(\d+)\.partial")
PARTIAL_SUFFIX = ".partial"
PURGING_SUFFIX = ".purging"
METADATA = ".metadata"
SIDECAR = "flame.json"
MANIFEST = "manifest.json"
# The checkpoint format this flame writes (flame.json's "format"): 1 holds no pickled entry of flame's own (RNG
# state as tensors, dataloader state as plain data); checkpoints without the field are format 0.
FORMAT = 1


class CheckpointError(FlameError):
    """A checkpoint that is missing, incomplete, or does not fit the model or tokenizer it is used with."""


def step_dir(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def partial_dir(folder: str | os.PathLike, step: int) -> Path:
    """Where a save of ``step`` is written until it is complete."""
    return Path(folder) / f"step-{step}{PARTIAL_SUFFIX}"


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / METADATA).is_file()


def list_steps(folder: str | os.PathLike) -> dict[int, bool]:
    """{step: complete} of the ``step-<N>`` directories in a checkpoint folder (exact names only); a step with only
    a ``step-<N>.partial`` directory (a save in flight or cut short) counts as incomplete."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    steps = {}
    for entry in folder.iterdir():
        if not entry.is_dir():
            continue
        if match := STEP_DIR.fullmatch(entry.name):
            steps[int(match.group(1))] = is_complete(entry)
        elif match := PARTIAL_DIR.fullmatch(entry.name):
            steps.setdefault(int(match.group(1)), False)
    return steps


def latest_step(folder: str | os.PathLike) -> int:
    """The highest step with a complete checkpoint, -1 if there is none."""
    return max((step for step, complete in list_steps(folder).items() if complete), default=-1)


NO_TRAINED_CHECKPOINT = (
    "No trained checkpoint to convert to HF (checkpointing off, or only a seed checkpoint)"
)


def has_trained_checkpoint(path: str | os.PathLike) -> bool:
    """Whether a dump folder (or checkpoint folder) holds a complete checkpoint past step 0: what the end-of-run
    export converts (a run without checkpoints, or with only its seed checkpoint, has nothing to export)."""
    try:
        return latest_step(checkpoint_folder(path)) > 0
    except CheckpointError:
        return False


def describe_steps(folder: str | os.PathLike) -> str:
    steps = list_steps(folder)
    complete = sorted(step for step, ok in steps.items() if ok)
    incomplete = sorted(step for step, ok in steps.items() if not ok)
    text = f"complete: {', '.join(map(str, complete))}" if complete else "no complete checkpoint"
    if incomplete:
        text += f"; interrupted saves: {', '.join(map(str, incomplete))}"
    return text


def resolve_step_dir(folder: str | os.PathLike, step: int) -> Path:
    """The directory of a complete checkpoint (step -1: the latest); CheckpointError naming what exists."""
    folder = Path(folder)
    if step == -1:
        step = latest_step(folder)
        if step == -1:
            raise CheckpointError(f"{folder} holds no complete checkpoint ({describe_steps(folder)})")
        return step_dir(folder, step)
    if step < 0:
        raise CheckpointError(f"step must be >= 0, or -1 for the latest checkpoint; got {step}")
    path = step_dir(folder, step)
    if not path.is_dir() and not partial_dir(folder, step).is_dir():
        raise CheckpointError(f"there is no checkpoint step-{step} in {folder} ({describe_steps(folder)})")
    if not is_complete(path):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {METADATA}: its save was interrupted); "
            f"load another step ({describe_steps(folder)}) or -1 for the latest complete one"
        )
    return path


def checkpoint_folder(path: str | os.PathLike, subfolder: str = "checkpoint") -> Path:
    """The checkpoint folder for a path that is a dump folder or the checkpoint folder itself. In a dump folder
    that is ``checkpoint/``, else the one subfolder holding step directories (a run's --checkpoint.folder)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist; pass a dump folder or its checkpoint folder")
    if (path / subfolder).is_dir():
        return path / subfolder
    if list_steps(path):
        return path
    candidates = [child for child in path.iterdir() if child.is_dir() and list_steps(child)]
    if len(candidates) == 1:
        return candidates[0]
    raise CheckpointError(f"{path} holds no {subfolder}/ folder and no step-<N> checkpoint")


def link_tree(source: Path, target: Path) -> None:
    """``target`` as a copy of ``source`` made of hard links (a plain copy where the file system has none): a
    checkpoint handed to a background thread, which a purge may then delete without taking its files."""
    for root, _, files in os.walk(source):
        folder = target / Path(root).relative_to(source)
        folder.mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(Path(root) / name, folder / name)
            except OSError:
                shutil.copy2(Path(root) / name, folder / name)


def hf_export_dir(folder: str | os.PathLike, step: int) -> Path:
    """Where checkpoint.convert_to_hf_on_save puts the HF export of step-<N>: step-<N>-hf beside it (never taken
    for a checkpoint: STEP_DIR matches whole names)."""
    return Path(folder) / f"step-{step}-hf"


def write_json(file: Path, data: dict) -> None:
    """Write a JSON file whole or not at all (a temporary name, flushed to disk, then renamed)."""
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(dumps_config(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(file)


def write_sidecar(path: str | os.PathLike, model_config: dict, tokenizer: str | None) -> None:
    info = {
        "model_config": model_config,
        "tokenizer": tokenizer,
        "flame_version": __version__,
        "format": FORMAT,
    }
    write_json(Path(path) / SIDECAR, info)


def read_sidecar(path: str | os.PathLike) -> dict | None:
    """flame.json of a step directory: {"model_config": {...}, "tokenizer": str | None, "flame_version": str,
    "format": int} (older checkpoints lack the last two), or None."""
    file = Path(path) / SIDECAR
    if not file.is_file():
        return None
    try:
        return loads_config(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e.msg}); remove it or pass --config") from e


# Fields that leave the function of a model alone: a resumed or converted checkpoint may differ in them.
NON_ARCHITECTURE_FIELDS = {"initializer_range", "bos_token_id", "eos_token_id", "max_position_embeddings"}


def config_differences(saved: dict, current: dict) -> list[str]:
    """'field: saved -> current' for every architecture field in which two model configs differ."""
    keys = sorted((set(saved) | set(current)) - NON_ARCHITECTURE_FIELDS)
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]
