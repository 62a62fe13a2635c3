"""Fixtures of the data tests: no network, an HF datasets cache of their own, the shipped tokenizer."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets is imported: nothing may come from the hub

import datasets  # noqa: E402
import pytest  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tests.data.helpers import TOKENIZER_DIR  # noqa: E402


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    """Arrow caches of the tests' datasets go to one temporary folder per session, not ~/.cache."""
    monkeypatch.setattr(
        datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets")
    )


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)
