"""Fixtures of the tool tests."""

from pathlib import Path

import pytest


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache that this process and its children use, offline."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache
