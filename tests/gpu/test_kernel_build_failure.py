"""A kernel that fails to build on the GPU where the dispatch table chose its backend earlier: in a compiled Gated
DeltaNet block, or in the backward pass (which runs in autograd's device thread here, not on the CPU tests' path:
tests/train/test_step.py). flame's short-convolution kernel raises Triton's error for a config past the GPU's
shared memory at its launch; the step takes the short convolution's Triton backend out with one log line and starts
over, and gives the loss of a run whose short convolution is the PyTorch code from the start. The gradient norm
agrees to within rtol 1e-5: FLA's backward kernels accumulate with atomics, so two runs of the same step differ in the
last bits."""

import json
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources

from flame.ops import dispatch
from flame.ops.short_conv import triton_kernel

REPO = Path(__file__).resolve().parents[2]


class Unbuildable:
    """In place of a Triton kernel: its launch fails to build (Triton's error for a config past the shared memory)."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise OutOfResources(232448, 166912, "shared memory")

        return launch


@pytest.fixture
def short_conv_op(monkeypatch):
    entry = dispatch._TABLE["short_conv"]
    monkeypatch.setattr(entry, "failed", {})
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(dispatch, "_PASSED_OVER", set())
    torch._dynamo.reset()
    yield entry
    torch._dynamo.reset()


@pytest.mark.parametrize("kernel", ["_fwd_kernel", "_bwd_kernel"])
@pytest.mark.parametrize("compiled", [True, False])
def test_a_kernel_that_fails_to_build_in_a_step_is_out_and_the_step_starts_over(
    make_trainer, tmp_path, short_conv_op, monkeypatch, caplog, kernel, compiled
):
    config = json.loads((REPO / "configs" / "gated_deltanet_340M.json").read_text())
    config.update(hidden_size=256, num_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=4096)
    (tmp_path / "model.json").write_text(json.dumps(config))
    flags = ["--model.config", str(tmp_path / "model.json"), "--training.seq_len", "256"]
    flags += ["--compile.enable"] if compiled else []
    trainer, reference = make_trainer(*flags), make_trainer(*flags)
    generator = torch.Generator("cuda").manual_seed(3)
    tokens = torch.randint(0, config["vocab_size"], (2, 257), device="cuda", generator=generator)
    batches = [({"input": tokens[:, :-1]}, tokens[:, 1:])]

    short_conv_op.failed["triton"] = (
        "is turned off (FLAME_BACKENDS_OFF)"  # the reference: PyTorch from the start
    )
    expected = reference.train_step_fn(batches)
    torch._dynamo.reset()
    short_conv_op.failed.clear()
    monkeypatch.setattr(triton_kernel, kernel, Unbuildable())
    caplog.clear()
    with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
        result = trainer.train_step_fn(batches)
    assert caplog.messages == [
        "short_conv: the triton backend failed to build its kernel (OutOfResources: out of resource: shared memory, "
        "Required: 232448, Hardware limit: 166912. Reducing block sizes or `num_stages` may help.); the pytorch "
        "implementation serves it"
    ]
    assert torch.equal(result.metrics["loss"], expected.metrics["loss"])
    torch.testing.assert_close(result.grad_norm, expected.grad_norm, rtol=1e-5, atol=0)
