"""Checking that a checkpoint on disk is whole: the manifest written at save (size and SHA-256 of every file) and
DCP's ``.metadata`` (readable, and every byte range it points to present in its file).

``python -m flame.checkpoint verify <dump_folder>`` runs this over every checkpoint of a run; a resumed run runs it
on the checkpoint it is about to load (``CheckpointManager.load``).
"""

import hashlib
import json
import os
from pathlib import Path

from flame.checkpoint.layout import MANIFEST, METADATA, is_complete, write_json

# Files of a step directory that the manifest does not cover: itself, and the temporary names of atomic writes.
_UNLISTED = {MANIFEST}


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(path: str | os.PathLike) -> None:
    """Record the size and SHA-256 of every file of a finished save (the last file written into it)."""
    path = Path(path)
    files = {
        entry.name: {"size": entry.stat().st_size, "sha256": file_digest(entry)}
        for entry in sorted(path.iterdir())
        if entry.is_file() and entry.name not in _UNLISTED and not entry.name.endswith(".tmp")
    }
    write_json(path / MANIFEST, {"files": files})


def _manifest_problem(path: Path, checksums: bool) -> str | None:
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    for name, recorded in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != recorded["size"]:
            return f"{name} is {size} bytes, {recorded['size']} when saved"
    if checksums:
        for name, recorded in files.items():
            if file_digest(path / name) != recorded["sha256"]:
                return f"{name} has changed since the save (SHA-256 differs)"
    return None


def _metadata_problem(path: Path) -> str | None:
    from flame.checkpoint.dcp_io import read_metadata

    try:
        metadata = read_metadata(path)
    except Exception as e:  # a truncated or garbled pickle raises anything from EOFError to UnpicklingError
        return f"its {METADATA} cannot be read ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < end:
            return f"{name} is {file.stat().st_size} bytes, shorter than the {end} its {METADATA} needs"
    return None


def checkpoint_problem(path: str | os.PathLike, checksums: bool = True) -> str | None:
    """Why the checkpoint in ``path`` cannot be loaded, or None if it verifies. Checkpoints without a manifest (saved
    before flame wrote them, or converted from HF) are checked against their ``.metadata`` alone."""
    path = Path(path)
    if not path.is_dir():
        return "it does not exist"
    if not is_complete(path):
        return f"it has no {METADATA} (its save was interrupted)"
    if (path / MANIFEST).is_file():
        problem = _manifest_problem(path, checksums)
        if problem:
            return problem
    return _metadata_problem(path)
