"""flame/hf/safetensors_io.py: HF weight files planned by huggingface_hub, written as flame wrote them before
(the same shard names, groups, index and permissions where no tensor exceeds the shard size)."""

import json
import os

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open

from flame.hf.safetensors_io import INDEX, SINGLE, load_safetensors, save_safetensors


def state(sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """float32 tensors of the given numbers of elements (4 bytes each), distinct values."""
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, generator=generator) for name, n in sizes.items()}


@pytest.fixture
def folder(tmp_path):
    return tmp_path


def test_sharded_layout_index_and_permissions(folder):
    # 400 + 400 bytes fit 1000; the third tensor starts a new shard (flame's layout before huggingface_hub planned it).
    tensors = state({"a": 100, "b": 100, "c": 100, "d": 50})
    files = save_safetensors(tensors, folder, 1000)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert files == [first, second, INDEX]
    index = json.loads((folder / INDEX).read_text())
    assert index == {
        "metadata": {"total_size": 1400},
        "weight_map": {"a": first, "b": first, "c": second, "d": second},
    }
    assert (folder / INDEX).read_text().endswith("}\n")
    mask = os.umask(0)
    os.umask(mask)
    for name in (first, second):
        assert (folder / name).stat().st_mode & 0o777 == 0o666 & ~mask
        with safe_open(str(folder / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    loaded = load_safetensors(folder)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_one_file_below_the_size_and_shared_tensors_written_twice(folder):
    tensors = state({"a": 100, "b": 10})
    tensors["tied"] = tensors["a"]
    assert save_safetensors(tensors, folder, 10**6) == [SINGLE]
    assert not (folder / INDEX).exists()
    loaded = load_safetensors(folder)
    assert torch.equal(loaded["tied"], tensors["a"]) and torch.equal(loaded["b"], tensors["b"])


@pytest.mark.parametrize("max_shard_bytes", [1000, 300])  # 300: "a" (400 bytes) is larger than a shard
def test_the_same_shards_as_huggingface_hub_writes(tmp_path, max_shard_bytes):
    tensors = state({"x": 20, "a": 100, "b": 30, "c": 100, "d": 50})
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    names = save_safetensors(tensors, ours, max_shard_bytes)
    save_torch_state_dict(tensors, theirs, max_shard_size=max_shard_bytes)
    assert sorted(names) == sorted(os.listdir(theirs))
    assert json.loads((ours / INDEX).read_text()) == json.loads((theirs / INDEX).read_text())
    for name in names[:-1]:
        with (
            safe_open(str(ours / name), framework="pt") as a,
            safe_open(str(theirs / name), framework="pt") as b,
        ):
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())  # noqa: SIM118
