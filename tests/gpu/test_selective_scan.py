"""flame's Triton selective scan on the GPU against the token-by-token recurrence in float64 on the CPU (the
interpreted CPU tests cover odd sizes; this one the compiled kernels at a layer's size: 2 x 300 tokens, 200
channels, 16 states, crossing the chunks and channel blocks of every split of the work below, the last of each
ragged; the inputs, their float32 A and the tolerances of tests/ops/interpreted/test_selective_scan_triton.py), and a
bf16 training step of mamba through flame (FLA's Mamba layers on flame's scan)."""

import functools

import pytest
import torch

from flame.models import build_model, model_args_from_dict
from flame.ops.selective_scan import selective_scan_recurrent
from flame.ops.selective_scan.triton_kernel import TILES as OP_TILES
from flame.ops.selective_scan.triton_kernel import ScanTiles, selective_scan_triton
from tests.ops.interpreted.test_selective_scan_triton import TOLERANCES, inputs, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# The op's split of the work and those bench/selective_scan.py --tiles compares it with: each one that the bench
# times is checked here.
TILES = ["16x8x4", "8x8x4", "32x8x4", "16x4x4", "16x16x4", "8x4x4", "16x8x8", "8x8x8", "16x8x2", "32x4x8", "16x16x2",
         "16x32x4", "16x8x1", "32x16x2", "16x32x2", "8x16x2", "32x8x2"]  # fmt: skip


@functools.cache
def problem(dtype):
    args, dy = inputs(dtype, batch=2, length=300, dim=200, states=16)
    return args, dy, run(selective_scan_recurrent, [t.double() for t in args], dy.double())


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_the_float64_recurrence(dtype, tiles):
    args, dy, reference = problem(dtype)
    scan = functools.partial(selective_scan_triton, tiles=ScanTiles.parse(tiles))
    ours = run(scan, [t.cuda() for t in args], dy.cuda())
    rtol, atol = TOLERANCES[dtype]
    for name, mine, want in zip(("y", "last", "u", "delta", "A", "B", "C"), ours, reference):
        torch.testing.assert_close(
            mine.cpu().double(), want, rtol=rtol, atol=atol * want.abs().max().item(), msg=name
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_documents_equal_the_float64_recurrence_of_each_document(dtype):
    """cu_seqlens over one row of 600 tokens (documents of 1, 150, 0 and 449 tokens, crossing chunk borders): the
    op's kernels against the recurrence over each document alone, the same tolerances."""
    lengths = [1, 150, 0, 449]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    args, dy = inputs(dtype, batch=1, length=sum(lengths), dim=200, states=16)
    reference = run(
        functools.partial(selective_scan_recurrent, cu_seqlens=bounds),
        [t.double() for t in args],
        dy.double(),
    )
    scan = functools.partial(selective_scan_triton, cu_seqlens=bounds.cuda())
    ours = run(scan, [t.cuda() for t in args], dy.cuda())
    rtol, atol = TOLERANCES[dtype]
    for name, mine, want in zip(("y", "states", "u", "delta", "A", "B", "C"), ours, reference, strict=True):
        torch.testing.assert_close(
            mine.cpu().double(), want, rtol=rtol, atol=atol * want.abs().max().item(), msg=name
        )


def test_the_ops_tiles_are_checked():
    assert str(OP_TILES) in TILES


def test_mamba_trains_a_bf16_step_on_flames_scan():
    args, _ = model_args_from_dict({"model_type": "mamba", "vocab_size": 512, "hidden_size": 128,
                                    "num_hidden_layers": 2, "state_size": 16})  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    model = model.to(torch.bfloat16).train()
    input_ids = torch.randint(0, 512, (2, 300), device="cuda")
    logits = model(input_ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
