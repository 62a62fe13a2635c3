"""The fused linear cross-entropy against flame/loss.py's loss_sums of the materialised logits: loss, cross-entropy
and z-term sums and the gradients w.r.t. hidden states and weight, on 37 tokens x vocabulary 101 (hidden 24) with
ignored tokens, chunk sizes that do not divide the tokens, z-loss on and off.
float64: rtol = atol = 1e-12 (the same sums in another order); float32: rtol = 1e-5, atol = 1e-6; bfloat16 inputs
against the reference on the same bfloat16 logits: rtol = 2e-2, atol = 1e-2 on bfloat16 gradients (one rounding
of the logit gradient per element; the weight gradient sums the chunks in float32 where unfused rounds once)."""

import pytest
import torch

from flame.loss import IGNORE_INDEX, loss_sums
from flame.ops import dispatch
from flame.ops.linear_cross_entropy import default_chunk_size, linear_cross_entropy

TOKENS, VOCAB, HIDDEN = 37, 101, 24
TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-2)}


def inputs(dtype, seed=0, ignored=9):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64) / 2).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[torch.randperm(TOKENS, generator=generator)[:ignored]] = IGNORE_INDEX
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def reference(hidden, weight, labels, z_loss):
    cross_entropy, z_term = loss_sums(hidden @ weight.T, labels, z_loss=z_loss > 0)
    loss = cross_entropy + z_loss * z_term
    return (loss, cross_entropy, z_term), torch.autograd.grad(loss, (hidden, weight))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("chunk_size", [5, 16, 37, 64])
def test_matches_the_unfused_loss(dtype, z_loss, chunk_size):
    hidden, weight, labels = inputs(dtype)
    (loss, *sums), expected_grads = reference(hidden, weight, labels, z_loss)
    fused = linear_cross_entropy(hidden, weight, labels, IGNORE_INDEX, z_loss, chunk_size)
    grads = torch.autograd.grad(fused[0], (hidden, weight))
    rtol, atol = TOLERANCES[dtype]
    sum_rtol = max(rtol, 1e-6)  # float32 sums in another order
    for name, actual, expected in zip(("loss", "cross_entropy", "z_term"), fused, (loss, *sums)):
        torch.testing.assert_close(actual, expected, rtol=sum_rtol, atol=atol, msg=f"{name} differs")
    for name, actual, expected in zip(("hidden", "weight"), grads, expected_grads):
        assert actual.dtype == dtype
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=f"grad {name} differs")
    assert fused[1].requires_grad is False and fused[2].requires_grad is False
    assert (fused[2] > 0) == (z_loss > 0)  # as loss_sums: the z-term only when it enters the loss


def test_scales_by_the_incoming_gradient_and_accumulates():
    """backward multiplies the gradients taken in forward by d(out)/d(loss); a second loss adds to .grad."""
    hidden, weight, labels = inputs(torch.float64, seed=1)
    (loss, _, _), (grad_hidden, grad_weight) = reference(hidden, weight, labels, 1e-3)
    (0.25 * linear_cross_entropy(hidden, weight, labels, z_loss=1e-3, chunk_size=7)[0]).backward()
    (0.5 * linear_cross_entropy(hidden, weight, labels, z_loss=1e-3, chunk_size=11)[0]).backward()
    torch.testing.assert_close(hidden.grad, 0.75 * grad_hidden, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight.grad, 0.75 * grad_weight, rtol=1e-12, atol=1e-12)


def test_without_gradients_and_all_tokens_ignored():
    hidden, weight, labels = inputs(torch.float64, seed=2)
    with torch.no_grad():
        loss, cross_entropy, z_term = linear_cross_entropy(hidden, weight, labels, z_loss=1e-2, chunk_size=8)
    expected, _ = reference(hidden, weight, labels, 1e-2)
    torch.testing.assert_close(loss, expected[0].detach(), rtol=1e-12, atol=1e-12)
    ignored = torch.full_like(labels, IGNORE_INDEX)
    loss, cross_entropy, z_term = linear_cross_entropy(hidden, weight, ignored, z_loss=1e-2, chunk_size=8)
    loss.backward()
    assert loss.item() == cross_entropy.item() == z_term.item() == 0
    assert not hidden.grad.any() and not weight.grad.any()


def test_batch_shape_autocast_and_bad_input():
    """[B, T, H] hidden states flatten like the logits do; under autocast the matmuls run in the autocast dtype,
    as lm_head's does (float32 weight, bfloat16 logits); mismatched shapes and chunk sizes are refused."""
    hidden, weight, labels = inputs(torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_cross_entropy(
            hidden.view(1, TOKENS, HIDDEN), weight, labels.view(1, TOKENS), chunk_size=6
        )
        unfused = loss_sums(hidden @ weight.T, labels, z_loss=False)[0]
    assert unfused.dtype == fused[0].dtype == torch.float32
    torch.testing.assert_close(fused[0], unfused, rtol=1e-6, atol=1e-6)
    grad_weight = torch.autograd.grad(fused[0], weight)[0]
    assert grad_weight.dtype == torch.float32
    with pytest.raises(ValueError, match="37 hidden states but 36 labels"):
        linear_cross_entropy(hidden, weight, labels[1:])
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)


def test_default_chunk_size_and_dispatch_entry():
    """Liger's rule: vocab / hidden chunks, the chunk size rounded up to a power of two."""
    assert default_chunk_size(16384, 32000, 1024) == 512
    assert default_chunk_size(37, 101, 24) == 8  # 5 chunks of ceil(37 / 5) = 8
    assert default_chunk_size(3, 10, 1024) == 4
    assert dispatch.backend_names("linear_cross_entropy") == ("liger", "torch", "fla")


def test_bench_smoke_on_cpu_writes_its_section(tmp_path, monkeypatch):
    """bench/linear_cross_entropy.py (a GPU benchmark) runs on the CPU at a tiny size and writes its table."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "linear_cross_entropy.py"
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location("bench_linear_cross_entropy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    doc = tmp_path / "performance.md"
    assert bench.main(["--device", "cpu", "--tiny", "--doc", str(doc)]) == 0
    section = doc.read_text().split("<!-- bench_linear_cross_entropy -->")[1]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| 96 x 300 x 32")]
    assert [row[1] for row in rows] == ["unfused (logits + loss_sums)", "flame fused (PyTorch, chunked)"]
    assert rows[0][-1] == rows[1][-1]  # the same loss per token, to 4 decimals


@pytest.mark.parametrize("z_loss", ["0", "0.001"])
def test_bench_calls_liger_as_flame_computes_the_loss(tmp_path, z_loss):
    """The bench's Liger row (Liger-Kernel's Triton kernels under Triton's interpreter, on the CPU) gives the unfused
    loss per token, z-loss included: the bench calls it with the arguments in its order, flame's ignore index and
    the z-loss as its lse_square_scale."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    doc = tmp_path / "performance.md"
    command = [sys.executable, str(repo / "bench" / "linear_cross_entropy.py"), "--device", "cpu", "--tiny",
               "--z_loss", z_loss, "--doc", str(doc)]  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    section = doc.read_text().split("<!-- bench_linear_cross_entropy -->")[1]
    rows = {
        r.split(" | ")[1]: r.split(" | ")[-1] for r in section.splitlines() if r.startswith("| 96 x 300 x 32")
    }
    assert set(rows) == {
        "unfused (logits + loss_sums)",
        "flame fused (PyTorch, chunked)",
        "Liger fused (Triton)",
    }
    assert rows["Liger fused (Triton)"] == rows["unfused (logits + loss_sums)"]


LIGER_AGAINST_FLAME = """
import sys, torch
from flame.ops.linear_cross_entropy import liger_linear_cross_entropy, linear_cross_entropy_torch
z_loss = float(sys.argv[1])
generator = torch.Generator().manual_seed(3)
hidden = torch.randn(37, 24, generator=generator, requires_grad=True)
weight = (torch.randn(101, 24, generator=generator) / 24**0.5).requires_grad_()
labels = torch.randint(0, 101, (37,), generator=generator)
labels[::7] = -100
for name, impl in (("liger", liger_linear_cross_entropy), ("torch", linear_cross_entropy_torch)):
    loss, cross_entropy, z_term = impl(hidden, weight, labels, -100, z_loss, 8, 0.0)
    grads = torch.autograd.grad(loss, (hidden, weight))
    print(name, *(f"{v:.17g}" for v in (loss.item(), cross_entropy.item(), z_term.item())), flush=True)
    torch.save(grads, f"{sys.argv[2]}/{name}.pt")
"""


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_liger_backend_matches_flames_loss_and_gradients(tmp_path, z_loss):
    """The liger backend (Liger-Kernel's Triton kernels under Triton's interpreter, on the CPU; float32, 37 tokens x
    vocabulary 101 x hidden 24, every seventh label ignored) returns flame's (loss, cross-entropy, z-term) and
    gradients: rtol 1e-5 on the sums, 1e-5 x max |reference| on the gradients (float32 sums in other orders)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-c", LIGER_AGAINST_FLAME, str(z_loss), str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    sums = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in done.stdout.splitlines()}
    torch.testing.assert_close(torch.tensor(sums["liger"]), torch.tensor(sums["torch"]), rtol=1e-5, atol=1e-6)
    if z_loss == 0:
        assert sums["liger"][2] == 0.0
    else:
        assert sums["liger"][0] > sums["liger"][1]  # the z-loss is in the loss
    for actual, expected in zip(torch.load(tmp_path / "liger.pt"), torch.load(tmp_path / "torch.pt")):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_cuda_calls_pinned_to_fla_reach_its_kernel_with_arguments_it_accepts(monkeypatch):
    """Without a GPU: CPU tensors that claim is_cuda walk the fla backend down to FLA 0.6.0's
    fused_linear_cross_entropy_loss, replaced by a recorder bound to its signature; with z-loss (which FLA lacks)
    the backend refuses the call and the PyTorch implementation serves it."""
    import inspect

    import fla.modules.fused_linear_cross_entropy as fla_module

    from tests.ops.test_dispatch import PretendCuda

    signature = inspect.signature(fla_module.fused_linear_cross_entropy_loss)
    calls = []

    def recorder(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs).arguments)
        return torch.tensor(5.0)

    monkeypatch.setattr(fla_module, "fused_linear_cross_entropy_loss", recorder)
    hidden, weight, labels = inputs(torch.float32, seed=4)
    dispatch.pin("linear_cross_entropy", "fla")
    try:
        pretend = hidden.as_subclass(PretendCuda)
        loss, cross_entropy, z_term = linear_cross_entropy(pretend, weight, labels, chunk_size=8)
        (arguments,) = calls
        assert arguments["reduction"] == "sum" and arguments["ignore_index"] == IGNORE_INDEX
        assert arguments["num_chunks"] == 5  # ceil(37 / 8)
        assert arguments["x"].shape == (TOKENS, HIDDEN) and arguments["weight"].shape == (VOCAB, HIDDEN)
        assert torch.equal(arguments["target"], labels)
        assert (loss.item(), cross_entropy.item(), z_term.item()) == (5.0, 5.0, 0.0)
        with_z = linear_cross_entropy(pretend, weight, labels, z_loss=1e-2, chunk_size=8)
    finally:
        dispatch.pin("linear_cross_entropy", None)
    assert len(calls) == 1
    expected = linear_cross_entropy(hidden, weight, labels, z_loss=1e-2, chunk_size=8)
    for actual, value in zip(with_z, expected):
        torch.testing.assert_close(actual.as_subclass(torch.Tensor), value, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [5, 64])
def test_l2_warp_in_the_chunks_matches_l2_warp_on_the_logits(dtype, chunk_size):
    """flame/loss.py's l2_warp on the materialised logits (the unfused objective) against the pull added chunk by
    chunk, ignored tokens included."""
    from flame.loss import l2_warp

    hidden, weight, labels = inputs(dtype)
    logits = hidden @ weight.T
    cross_entropy, _ = loss_sums(logits, labels, z_loss=False)
    expected = torch.autograd.grad(
        l2_warp(cross_entropy, logits, labels, 1e-2), (hidden, weight), retain_graph=True
    )
    fused = linear_cross_entropy(hidden, weight, labels, IGNORE_INDEX, 0.0, chunk_size, l2warp=1e-2)
    grads = torch.autograd.grad(fused[0], (hidden, weight))
    unwarped = torch.autograd.grad(cross_entropy, (hidden, weight))
    rtol, atol = TOLERANCES[dtype]
    for grad, want, plain in zip(grads, expected, unwarped):
        torch.testing.assert_close(grad, want, rtol=rtol, atol=atol)
        assert not torch.allclose(grad, plain, rtol=rtol, atol=atol)  # the pull is there
