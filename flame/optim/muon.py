"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the 2-D weight matrices of the blocks.

The method is Keller Jordan's (https://kellerjordan.github.io/posts/muon/): keep a momentum of the gradient,
replace the (Nesterov) update G = U S V^T by an approximation of U V^T, and step along it. The approximation is
the quintic Newton-Schulz iteration X <- a X + (b X X^T + c (X X^T)^2) X, started from G / ||G||_F (the Frobenius
norm bounds the spectral norm, so every singular value starts in [0, 1]); with Jordan's coefficients
(3.4445, -4.7750, 2.0315) five iterations take every singular value of at least ||G||_F / 200 into
[0.68, 1.16] (not to 1: the iteration trades exact convergence for a steep start at 0). The iteration works on
the smaller Gram matrix (the transpose of a tall matrix).

The step is scaled as Moonlight does (Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982):
an orthogonal m x n update has RMS 1 / sqrt(max(m, n)); times 0.2 sqrt(max(m, n)) its RMS is 0.2, the RMS of
a typical AdamW update, so the learning rate and weight decay tuned for AdamW carry over. Weight decay is
decoupled (p <- p (1 - lr wd), as AdamW).

torch.optim.Muon (torch >= 2.9) implements the same method but runs the iteration in bfloat16 only and on the
tensor it is given: under FSDP2 that is one rank's rows of the matrix, whose orthogonalisation is not the
matrix's. This class orthogonalises whole matrices instead (``orthogonalize``), each on one rank: the shards of
a stack of updates are exchanged so that every rank holds whole matrices, 1/N of the stack (an all-to-all over the
N ranks that shard them), each rank iterates on its own, and a second exchange returns every rank its rows. The
iteration's compute and the traffic are divided among the ranks instead of repeated on each.

A step is a few launches per shape, not per matrix: the momentum, the weight decay and the update are foreach ops
over the parameters' local tensors, and the matrices of one shape and layout are stacked into one batched
Newton-Schulz iteration. One matrix at a time, the iteration's 20-odd small kernels and DTensor's dispatch bind the
step to the host (docs/performance.md, "Muon against AdamW").
"""

import math
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from flame.models.layers.sharding import local_tensor

# Keller Jordan's quintic coefficients (the post above): a steep slope at 0 (3.4445) while five iterations of
# the polynomial keep [1/200, 1] within [0.68, 1.16].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# The most elements a stack of matrices orthogonalised together holds: it bounds the stack's memory (its copies
# and the iteration's products, a few times this in the iteration's dtype) for large matrices.
STACK_ELEMENTS = 1 << 26


def newton_schulz(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """U f(S) V^T for matrix = U S V^T, f the iterated quintic on S / ||matrix||_F; in ``dtype``. A stack
    [..., m, n] is orthogonalised matrix by matrix."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    wide_shape = x.shape
    x = x.reshape(-1, *wide_shape[-2:])
    # The norm in float32 at least; the clamp keeps a zero update zero.
    norm = torch.linalg.matrix_norm(x.float() if x.dtype == torch.bfloat16 else x, keepdim=True)
    x = x / norm.clamp_min(1e-7).to(dtype)
    for _ in range(steps):
        gram = x @ x.mT
        # b gram + c gram^2, then a x + (that) x: the scalings ride in the matmuls.
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, polynomial, x, beta=a)
    x = x.reshape(wide_shape)
    return x.mT if tall else x


def _layout(param: torch.Tensor):
    """What decides how a parameter's update is gathered: its shape, and a DTensor's mesh and placements."""
    if isinstance(param, DTensor):
        return tuple(param.shape), param.device_mesh, tuple(param.placements)
    return tuple(param.shape), None, None


def _stacked_placements(placements) -> list | None:
    """The placements of a stack [G, m, n] of matrices laid out as ``placements``: each shard moves one dimension
    up. None for placements other than Shard and Replicate (strided shards of FSDP2 over tensor parallelism)."""
    if not all(type(p) in (Shard, Replicate) for p in placements):
        return None
    return [Shard(p.dim + 1) if isinstance(p, Shard) else p for p in placements]


def _owner_placements(placements) -> list | None:
    """Placements of a stack that give every rank whole matrices: the stack split over the first mesh dimension
    that shards the matrices, replicated over the others. None where no mesh dimension shards them."""
    sharding = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if not sharding:
        return None
    return [Shard(0) if i == sharding[0] else Replicate() for i in range(len(placements))]


def _orthogonalize_stack(updates: list[torch.Tensor], like: torch.Tensor, steps: int, dtype: torch.dtype):
    """newton_schulz of each whole matrix of a stack of local updates laid out as ``like``; each rank's parts, in
    the updates' dtype (one cast per stack each way)."""
    stack = torch.stack(updates, out=updates[0].new_empty((len(updates), *updates[0].shape), dtype=dtype))
    owners = _owner_placements(like.placements) if isinstance(like, DTensor) else None
    if owners is None:  # every rank holds whole matrices
        return newton_schulz(stack, steps, dtype).to(updates[0].dtype).unbind(0)
    mesh = like.device_mesh
    placements = _stacked_placements(like.placements)
    shape = torch.Size((len(updates), *like.shape))
    stride = torch.empty(shape, device="meta").stride()
    sharded = DTensor.from_local(stack, mesh, placements, run_check=False, shape=shape, stride=stride)
    owned = newton_schulz(sharded.redistribute(mesh, owners).to_local(), steps, dtype)
    result = DTensor.from_local(owned, mesh, owners, run_check=False, shape=shape, stride=stride)
    return result.redistribute(mesh, placements).to_local().to(updates[0].dtype).unbind(0)


def _orthogonalize_one(update: torch.Tensor, like: DTensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """newton_schulz of one whole matrix from its local update, for any placements; this rank's part, in the
    update's dtype."""
    mesh = like.device_mesh
    sharded = DTensor.from_local(
        update.to(dtype), mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
    full = newton_schulz(sharded.full_tensor(), steps, dtype)
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local().to(update.dtype)


def orthogonalize(
    updates: list[torch.Tensor], params: list[torch.Tensor], steps: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """newton_schulz of each whole matrix, in its update's dtype: ``updates`` are the local parts of updates laid
    out as ``params`` (a DTensor's shards, FSDP2's rows, HSDP or tensor parallelism, are gathered and each rank
    keeps its own part of the result). Matrices of one layout are stacked and orthogonalised together."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    by_layout = defaultdict(list)
    for index, param in enumerate(params):
        by_layout[_layout(param)].append(index)
    for (shape, _, placements), indices in by_layout.items():
        like = params[indices[0]]
        if placements is not None and _stacked_placements(placements) is None:
            for i in indices:
                results[i] = _orthogonalize_one(updates[i], like, steps, dtype)
        else:
            per_stack = max(1, STACK_ELEMENTS // math.prod(shape))
            for start in range(0, len(indices), per_stack):
                chunk = indices[start : start + per_stack]
                for i, result in zip(
                    chunk, _orthogonalize_stack([updates[i] for i in chunk], like, steps, dtype)
                ):
                    results[i] = result
    return results


def rms_matching_scale(shape: torch.Size) -> float:
    """Moonlight's factor 0.2 sqrt(max(m, n)): the update's RMS becomes 0.2, as AdamW's."""
    return 0.2 * math.sqrt(max(shape))


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters (the module docstring has the method). Per parameter:

    B <- momentum B + (1 - momentum) G;  U = G + momentum (B - G) with Nesterov, else B;
    p <- p (1 - lr weight_decay) - lr 0.2 sqrt(max(m, n)) newton_schulz(U).

    ``ns_dtype`` ("bfloat16", as Jordan's reference, or "float32") is the iteration's dtype.
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_dtype: str = "bfloat16",
    ):
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "ns_steps": ns_steps,
        }
        super().__init__(params, defaults)
        self.ns_dtype = NS_DTYPES[ns_dtype]
        for group in self.param_groups:
            for param in group["params"]:
                if param.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got one of shape {tuple(param.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            for param in params:
                if "momentum_buffer" not in self.state[param]:
                    self.state[param]["momentum_buffer"] = torch.zeros_like(param.grad)
            grads = [local_tensor(param.grad) for param in params]
            buffers = [local_tensor(self.state[param]["momentum_buffer"]) for param in params]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            updates = orthogonalize(updates, params, group["ns_steps"], self.ns_dtype)
            weights = [local_tensor(param) for param in params]
            torch._foreach_mul_(weights, 1 - lr * group["weight_decay"])
            by_shape = defaultdict(list)
            for index, param in enumerate(params):
                by_shape[param.shape].append(index)
            for shape, indices in by_shape.items():
                torch._foreach_add_(
                    [weights[i] for i in indices],
                    [updates[i] for i in indices],
                    alpha=-lr * rms_matching_scale(shape),
                )
        return loss
