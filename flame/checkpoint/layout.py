"""Where checkpoints live and which of them are complete (no torch import: the converters' checks stay fast).

A run's checkpoints are torchtitan's: ``<dump_folder>/<checkpoint.folder>/step-<N>/``, each a DCP checkpoint whose
``.metadata`` file the coordinating rank writes last, after every rank's data files (torch's FileSystemWriter writes
it to a temporary name and renames it). A step directory without ``.metadata`` is therefore a save that did not
finish (killed, out of disk ...): it is never loaded as "latest", and loading it by number fails with one line.

Next to ``.metadata`` flame writes ``flame.json`` before the data: the model config the weights belong to and the
tokenizer of the run, so that converters and resumed runs can check what they load.
"""

import json
import os
import re
from pathlib import Path

from flame.errors import FlameError

STEP_DIR = re.compile(r"step-(\d+)")
METADATA = ".metadata"
SIDECAR = "flame.json"


class CheckpointError(FlameError):
    """A checkpoint that is missing, incomplete, or does not fit the model or tokenizer it is used with."""


def step_dir(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / METADATA).is_file()


def list_steps(folder: str | os.PathLike) -> dict[int, bool]:
    """{step: complete} of the ``step-<N>`` directories in a checkpoint folder (exact names only)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    steps = {}
    for entry in folder.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            steps[int(match.group(1))] = is_complete(entry)
    return steps


def latest_step(folder: str | os.PathLike) -> int:
    """The highest step with a complete checkpoint, -1 if there is none."""
    return max((step for step, complete in list_steps(folder).items() if complete), default=-1)


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
    if not path.is_dir():
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


def write_sidecar(path: str | os.PathLike, model_config: dict, tokenizer: str | None) -> None:
    info = {"model_config": model_config, "tokenizer": tokenizer}
    tmp = Path(path) / (SIDECAR + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(Path(path) / SIDECAR)


def read_sidecar(path: str | os.PathLike) -> dict | None:
    """flame.json of a step directory: {"model_config": {...}, "tokenizer": str | None}, or None."""
    file = Path(path) / SIDECAR
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e.msg}); remove it or pass --config") from e


# Fields that leave the function of a model alone: a resumed or converted checkpoint may differ in them.
NON_ARCHITECTURE_FIELDS = {"initializer_range", "bos_token_id", "eos_token_id", "max_position_embeddings"}


def config_differences(saved: dict, current: dict) -> list[str]:
    """'field: saved -> current' for every architecture field in which two model configs differ."""
    keys = sorted((set(saved) | set(current)) - NON_ARCHITECTURE_FIELDS)
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]
