"""The device prefetcher on one GPU: batches copied on its own stream from the loader's pinned memory arrive on the
GPU with the loader's values, in the loader's order, while the default stream is busy."""

import pytest
import torch
from transformers import AutoTokenizer

from flame.data import build_dataloader
from flame.data.prefetch import DevicePrefetcher
from tests.data.helpers import TOKENIZER_DIR, job_config, take


@pytest.mark.parametrize("ahead", [1, 3])
def test_prefetched_batches_reach_the_gpu_with_the_loaders_values(ahead):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = job_config(seq_len=512, batch_size=4)  # workers and pinning chosen for the GPU
    expected = take(build_dataloader(config, tokenizer, device_type="cuda"), 8)
    loader = build_dataloader(config, tokenizer, device_type="cuda")
    assert loader.num_workers > 0 and loader.pin_memory
    prefetcher = DevicePrefetcher(loader, torch.device("cuda"), ahead=ahead)
    iter(prefetcher)
    busy = torch.randn(4096, 4096, device="cuda")
    for step, (expected_inputs, expected_labels) in enumerate(expected):
        inputs, labels = next(prefetcher)
        assert inputs["input"].is_cuda and labels.is_cuda
        # Read on the default stream right away, as the step's first kernels do, with the GPU still busy.
        total = inputs["input"].sum() + labels.sum()
        prefetcher.prefetch()
        for _ in range(4):
            busy = busy @ busy / 64
        assert torch.equal(inputs["input"].cpu(), expected_inputs["input"]), step
        assert torch.equal(labels.cpu(), expected_labels), step
        assert total.item() == (expected_inputs["input"].sum() + expected_labels.sum()).item()
