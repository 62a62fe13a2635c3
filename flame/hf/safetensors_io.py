"""Safetensors files as transformers writes and reads them: one ``model.safetensors``, or above a size threshold
shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (total size, weight map)."""

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flame.errors import FlameError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def parse_size(text: str | int) -> int:
    """'5GB', '200MB', '1.5GiB' or a number of bytes."""
    if isinstance(text, int):
        return text
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    value = text.strip().upper()
    unit = next((unit for unit in units if value.endswith(unit)), None)
    number, factor = (value[: -len(unit)].strip(), units[unit]) if unit else (value, 1)
    try:
        size = int(float(number) * factor)
    except ValueError:
        raise FlameError(
            f"cannot read the size {text!r}; write e.g. 5GB, 500MB or a number of bytes"
        ) from None
    if size <= 0:
        raise FlameError(f"the shard size must be positive, got {text!r}")
    return size


def shard_plan(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped into shards of at most max_shard_bytes each (a larger single tensor gets its own shard)."""
    shards, current, size = [], [], 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def save_safetensors(
    state: dict[str, torch.Tensor], folder: str | os.PathLike, max_shard_bytes: int
) -> list[str]:
    """Write the tensors (already in their export dtype) into folder; returns the file names written."""
    folder = Path(folder)
    shards = shard_plan(state, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    seen = set()
    for name, keys in zip(names, shards):
        tensors = {}
        for key in keys:
            tensor = state[key].detach().contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses tensors that share memory
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[key] = tensor
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        os.chmod(folder / name, 0o666 & ~_umask())  # safetensors creates its files private
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {key: name for name, keys in zip(names, shards) for key in keys},
        }
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return [*names, INDEX]
    return names


def weight_files(folder: str | os.PathLike) -> list[Path]:
    folder = Path(folder)
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())
        return [folder / name for name in sorted(set(index["weight_map"].values()))]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    raise FlameError(f"{folder} holds no {SINGLE} and no {INDEX}")


def load_safetensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    state = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                state[key] = f.get_tensor(key)
    return state


def existing_export_files(folder: str | os.PathLike) -> list[Path]:
    """Weight files of an earlier export in folder (removed before a new export writes its own)."""
    folder = Path(folder)
    return [p for p in folder.glob("model*.safetensors")] + (
        [folder / INDEX] if (folder / INDEX).exists() else []
    )
