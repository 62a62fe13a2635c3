"""tests/gpu needs CUDA: it is collected only on a machine with a GPU (run it there: pytest tests/gpu).
tests/ops/interpreted runs Triton kernels in Triton's CPU interpreter, in a subprocess (see below).

``make_trainer`` (tests/trainer_helpers.py) builds flame's Trainer in-process for any test.
"""

import os
from pathlib import Path

import pytest
import torch

from tests.trainer_helpers import make_trainer  # noqa: F401  (fixture)

collect_ignore = [] if torch.cuda.is_available() else ["gpu"]
# Triton's interpreter must be chosen before triton is imported: tests/ops/test_triton_kernels_interpreted.py runs
# these in a subprocess with TRITON_INTERPRET=1.
if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore.append("ops/interpreted")


def pytest_configure(config):
    # pytest-xdist hands the workers whole files (--dist loadfile) in the order of their number of tests unless told
    # not to; in the collection order below instead, so that the slow files start first and the run does not end on
    # one worker with a slow file while the other has finished.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files with a test marked slow first; each file's tests stay together, in their order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True)
def titan_logger_without_stale_streams():
    """A test running flame's main() in-process leaves torchtitan's logger writing to that test's captured stdout,
    which pytest closes; later tests' log lines would then end in "Logging error: I/O operation on closed file"."""
    yield
    from torchtitan.tools.logging import logger

    for handler in list(logger.handlers):
        if getattr(getattr(handler, "stream", None), "closed", False):
            logger.removeHandler(handler)


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
