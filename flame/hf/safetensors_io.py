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


def save_safetensors(
    state: dict[str, torch.Tensor], folder: str | os.PathLike, max_shard_bytes: int
) -> list[str]:
    """Write the tensors (already in their export dtype) into folder; returns the file names written.

    The shards are huggingface_hub's (``split_torch_state_dict_into_shards``, what transformers' save_pretrained
    uses): tensors in order, a new shard when the next one would pass max_shard_bytes, a larger tensor alone."""
    from huggingface_hub import split_torch_state_dict_into_shards

    folder = Path(folder)
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_bytes
    )
    seen = set()
    for name, keys in split.filename_to_tensors.items():
        tensors = {}
        for key in keys:
            tensor = state[key].detach().contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses tensors that share memory
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[key] = tensor
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        os.chmod(folder / name, 0o666 & ~_umask())  # safetensors creates its files private
    names = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {key: name for name, keys in split.filename_to_tensors.items() for key in keys},
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
