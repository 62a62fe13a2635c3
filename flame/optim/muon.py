"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the 2-D weight matrices of the blocks.

The method is Keller Jordan's (https://kellerjordan.github.io/posts/muon/): keep a momentum of the gradient,
replace the (Nesterov) update G = U S V^T by an approximation of U V^T, and step along it. The approximation is
the quintic Newton-Schulz iteration X <- a X + (b X X^T + c (X X^T)^2) X, started from G / ||G||_F (the Frobenius
norm bounds the spectral norm, so every singular value starts in [0, 1]); with Jordan's coefficients
(3.4445, -4.7750, 2.0315) five iterations take every singular value of at least ||G||_F / 200 into
[0.68, 1.16] (not to 1: the iteration trades exact convergence for a steep start at 0). The iteration works on the smaller
Gram matrix (the transpose of a tall matrix).

The step is scaled as Moonlight does (Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982):
an orthogonal m x n update has RMS 1 / sqrt(max(m, n)); times 0.2 sqrt(max(m, n)) its RMS is 0.2, the RMS of
a typical AdamW update, so the learning rate and weight decay tuned for AdamW carry over. Weight decay is
decoupled (p <- p (1 - lr wd), as AdamW).

torch.optim.Muon (torch >= 2.9) implements the same method but runs the iteration in bfloat16 only and on the
tensor it is given: under FSDP2 that is one rank's rows of the matrix, whose orthogonalisation is not the
matrix's. This class gathers each matrix instead (``orthogonalize``): every rank all-gathers the update of each
matrix (in the iteration's dtype), orthogonalises the whole matrix and keeps its own rows. The compute is
repeated on every rank, which costs 5 x 3 matmuls per matrix per step, small against a step's forward and
backward for the block sizes flame trains; handing whole matrices to different ranks would divide it but needs
a scatter back per matrix.
"""

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

# Keller Jordan's quintic coefficients (the post above): a steep slope at 0 (3.4445) while five iterations of
# the polynomial keep [1/200, 1] within [0.68, 1.16].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """U f(S) V^T for matrix = U S V^T, f the iterated quintic on S / ||matrix||_F; in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    # The norm in float32 at least; the clamp keeps a zero update zero.
    norm = torch.linalg.matrix_norm(x.float() if x.dtype == torch.bfloat16 else x)
    x = x / norm.clamp_min(1e-7).to(dtype)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """newton_schulz of the whole matrix, in update's dtype and layout: a DTensor's shards (FSDP2's rows, HSDP,
    tensor parallelism) are gathered, and each rank keeps its own part of the result."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype).to(update.dtype)
    mesh = update.device_mesh
    full = newton_schulz(update.to(dtype).full_tensor(), steps, dtype).to(update.dtype)
    # Replicate -> the original placements takes each rank's part locally, without communication.
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, update.placements)


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
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalize(update, group["ns_steps"], self.ns_dtype)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-lr * rms_matching_scale(param.shape))
        return loss
