"""Muon (flame.optim.muon): the Newton-Schulz iteration against its SVD form, stacks of matrices against one
matrix at a time, the step against a float64 reference, whole matrices gathered from the shards of 2 gloo ranks,
the Muon/AdamW split, and a run that trains and resumes exactly. FSDP2 on 2 gloo ranks against one process: the
fsdp2_muon setting of tests/parallelize/test_parallel_training.py."""

import json
import math
from pathlib import Path

import pytest
import torch

from flame.config import parse_args
from flame.optim import build_optimizers, muon
from flame.optim.muon import NS_COEFFICIENTS, Muon, newton_schulz, orthogonalize
from flame.optim.optimizer import MuonOptimizersContainer
from tests.models.helpers import tiny_model
from tests.trainer_helpers import tensorboard_scalars

ODD_SHAPES = [(37, 91), (91, 37), (129, 50), (3, 200)]


def svd_reference(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """U f(S / ||M||_F) V^T in float64, f the quintic iterated on the singular values alone: what the matrix
    iteration computes, without its rounding."""
    a, b, c = NS_COEFFICIENTS
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    x = s / matrix.double().norm()
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return u @ torch.diag(x) @ vh


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_newton_schulz_is_the_svd_form_and_near_orthogonal(shape):
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    reference = svd_reference(matrix)
    # float32 rounding of 15 matmuls on entries below 0.4 (observed <= 1.1e-6).
    torch.testing.assert_close(
        newton_schulz(matrix, dtype=torch.float32).double(), reference, rtol=0, atol=5e-6
    )
    torch.testing.assert_close(
        newton_schulz(matrix.double(), dtype=torch.float64), reference, rtol=0, atol=1e-12
    )
    # Rectangular Gaussian matrices have no singular value below ||M||_F / 200: all end in the documented band
    # [0.68, 1.16]; bfloat16's rounding widens it by 0.02 (observed [0.673, 1.134]).
    assert (torch.linalg.svdvals(matrix.double()) / matrix.double().norm()).min() > 1 / 200
    for dtype, (low, high) in ((torch.float32, (0.68, 1.16)), (torch.bfloat16, (0.66, 1.18))):
        singular_values = torch.linalg.svdvals(newton_schulz(matrix, dtype=dtype).double())
        assert low <= singular_values.min() and singular_values.max() <= high, (dtype, singular_values)


@pytest.mark.parametrize("shape", [(3, 37, 91), (2, 91, 37)])
def test_a_stack_is_orthogonalised_matrix_by_matrix(shape):
    stack = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    one_by_one = torch.stack([newton_schulz(matrix, dtype=torch.float64) for matrix in stack])
    torch.testing.assert_close(newton_schulz(stack, dtype=torch.float64), one_by_one, rtol=0, atol=1e-12)


def test_two_steps_match_the_float64_formula():
    """momentum buffer, Nesterov mix, decoupled weight decay and Moonlight's 0.2 sqrt(max(m, n)) scale."""
    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(23, 57, generator=g))
    grads = [torch.randn(23, 57, generator=g) for _ in range(2)]
    lr, momentum, weight_decay = 0.02, 0.9, 0.1
    optimizer = Muon([param], lr=lr, momentum=momentum, weight_decay=weight_decay, ns_dtype="float32")
    expected, buffer = param.detach().double().clone(), torch.zeros(23, 57, dtype=torch.float64)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        buffer = momentum * buffer + (1 - momentum) * grad.double()
        update = svd_reference(grad.double() + momentum * (buffer - grad.double()))
        expected = expected * (1 - lr * weight_decay) - lr * 0.2 * math.sqrt(57) * update
    torch.testing.assert_close(param.detach().double(), expected, rtol=0, atol=2e-6)
    # The update's RMS is AdamW's 0.2 (times the band of the singular values).
    assert 0.2 * 0.68 < (0.2 * math.sqrt(57) * svd_reference(grads[0])).pow(2).mean().sqrt() < 0.2 * 1.16


def test_a_step_over_matrices_of_several_shapes_matches_the_float64_formula(monkeypatch):
    """Matrices of one shape share stacks (two per stack here, so three of one shape make two stacks); a
    parameter without a gradient is left alone."""
    monkeypatch.setattr(muon, "STACK_ELEMENTS", 2 * 23 * 57)
    g = torch.Generator().manual_seed(2)
    shapes = [(23, 57), (57, 23), (23, 57), (5, 9), (23, 57)]
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in shapes]
    idle = torch.nn.Parameter(torch.randn(7, 7, generator=g))
    lr, momentum, weight_decay = 0.02, 0.9, 0.1
    optimizer = Muon([*params, idle], lr=lr, momentum=momentum, weight_decay=weight_decay, ns_dtype="float32")
    expected = [p.detach().double().clone() for p in params]
    buffers = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
    idle_before = idle.detach().clone()
    for _ in range(2):
        grads = [torch.randn(*shape, generator=g) for shape in shapes]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer.step()
        for i, grad in enumerate(grads):
            buffers[i] = momentum * buffers[i] + (1 - momentum) * grad.double()
            update = svd_reference(grad.double() + momentum * (buffers[i] - grad.double()))
            scale = 0.2 * math.sqrt(max(shapes[i]))
            expected[i] = expected[i] * (1 - lr * weight_decay) - lr * scale * update
    for param, want in zip(params, expected):
        torch.testing.assert_close(param.detach().double(), want, rtol=0, atol=2e-6)
    assert torch.equal(idle.detach(), idle_before) and idle not in optimizer.state


def _sharded_worker(rank: int, world: int, rendezvous: str, out: str) -> None:
    """Each rank orthogonalises its parts of matrices laid out over the ranks; the parts must be those of the whole
    matrices' iteration. 2 ranks: rows (uneven: 37 rows), columns, a lone (3, 91) matrix (one rank owns it, the
    other none), strided rows (FSDP2 over tensor parallelism; gathered one by one). 4 ranks as 2 x 2: HSDP's
    layout (replicated, rows) and rows x columns."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        if world == 2:
            mesh = init_device_mesh("cpu", (2,))
            cases = [
                ((37, 91), [Shard(0)]),
                ((37, 91), [Shard(0)]),
                ((37, 91), [Shard(0)]),
                ((91, 37), [Shard(1)]),
                ((3, 91), [Shard(0)]),
                ((40, 24), [_StridedShard(0, split_factor=2)]),
            ]
        else:
            mesh = init_device_mesh("cpu", (2, 2))
            cases = [
                ((37, 91), [Replicate(), Shard(0)]),
                ((37, 91), [Replicate(), Shard(0)]),
                ((37, 91), [Replicate(), Shard(0)]),
                ((30, 45), [Shard(0), Shard(1)]),
                ((30, 45), [Shard(0), Shard(1)]),
            ]
        g = torch.Generator().manual_seed(3)
        wholes = [torch.randn(*shape, dtype=torch.float64, generator=g) for shape, _ in cases]
        layouts = [distribute_tensor(w, mesh, placements) for w, (_, placements) in zip(wholes, cases)]
        errors = {}
        # The iteration in float64, and in float32 on float64 updates (the parts come back in float64).
        for dtype in (torch.float64, torch.float32):
            parts = orthogonalize([d.to_local() for d in layouts], layouts, 5, dtype)
            errors[str(dtype)] = []
            for whole, layout, part in zip(wholes, layouts, parts):
                want = distribute_tensor(
                    newton_schulz(whole, dtype=dtype), mesh, layout.placements
                ).to_local()
                same = tuple(part.shape) == tuple(want.shape) and part.dtype == torch.float64
                errors[str(dtype)].append((same, (part - want.double()).abs().max().item()))
        Path(out.format(rank=rank)).write_text(json.dumps(errors))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_matrices_are_orthogonalised_whole(tmp_path, world):
    import torch.multiprocessing as mp

    out = str(tmp_path / "rank{rank}.json")
    mp.spawn(_sharded_worker, args=(world, str(tmp_path / "rendezvous"), out), nprocs=world, join=True)
    # float32: the stacked iteration against one matrix's, both rounding 15 matmuls (observed <= 1e-6).
    tolerances = {"torch.float64": 1e-12, "torch.float32": 5e-6}
    for rank in range(world):
        errors = json.loads(Path(out.format(rank=rank)).read_text())
        for dtype, tolerance in tolerances.items():
            assert len(errors[dtype]) == (6 if world == 2 else 5)
            for same, error in errors[dtype]:
                assert same and error < tolerance, (rank, dtype, error)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny_model("gated_deltanet", head_dim=8, num_heads=2, attn={"layers": [1], "num_heads": 4})
    optimizers = build_optimizers(
        [model], parse_args(["--optimizer.name", "Muon", "--optimizer.no-decay-embeddings"])
    )
    assert isinstance(optimizers, MuonOptimizersContainer)
    muon, adamw = optimizers.optimizers
    assert isinstance(muon, Muon) and type(adamw) is torch.optim.AdamW
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)]: g["weight_decay"] for g in adamw.param_groups for p in g["params"]}
    blocks_2d = {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    assert in_muon == blocks_2d and "layers.1.attn.q_proj.weight" in in_muon
    assert set(in_adamw) == {n for n, _ in model.named_parameters()} - blocks_2d
    assert in_adamw["lm_head.weight"] == 0.1 and in_adamw["embeddings.weight"] == 0.0
    assert (
        in_adamw["layers.0.attn.A_log"] == 0.0 and "layers.0.attn.q_conv1d.weight" in in_adamw
    )  # 3-D kernel


# ---- A tiny run ----
def test_run_trains_and_resumes_exactly(make_trainer, tmp_path):
    flags = ["--optimizer.name", "Muon", "--optimizer.lr", "1e-2", "--training.steps", "4", "--checkpoint.enable",
             "--checkpoint.interval", "2"]  # fmt: skip
    make_trainer(*flags, dump=tmp_path / "whole").train()
    make_trainer(*flags, "--training.stop_at_step", "2", dump=tmp_path / "resumed").train()
    resumed = make_trainer(*flags, dump=tmp_path / "resumed")
    resumed.train()
    assert resumed.step == 4
    whole = tensorboard_scalars(tmp_path / "whole", "loss/train")
    assert whole[4] < whole[1] - 0.5, whole
    for tag in ("loss/train", "grad_norm"):
        assert tensorboard_scalars(tmp_path / "resumed", tag) == tensorboard_scalars(
            tmp_path / "whole", tag
        ), tag
