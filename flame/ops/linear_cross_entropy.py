"""Fused linear cross-entropy: the language-model loss straight from the final hidden states and the lm_head weight,
without the [tokens, vocab] logits of the whole batch.

``linear_cross_entropy(hidden, weight, labels, z_loss)`` returns ``(loss, cross_entropy, z_term)``: the summed
cross-entropy over the labelled tokens, the summed z-loss term logsumexp(logits)^2 over the same tokens (zero
unless z_loss > 0; both detached, for the metrics) and ``loss = cross_entropy + z_loss * z_term``, the one differentiable output. These are
flame/loss.py's ``loss_sums`` of ``hidden @ weight.T`` (same ignore index, same z-loss, sums: the caller divides by
the step's labelled-token count), with the logits computed in the matmul dtype and the softmax in float32
(float64 inputs stay float64).

The PyTorch implementation walks the tokens in chunks: per chunk it computes the logits, their logsumexp, the loss
and at once the gradient of the loss with respect to the logits, multiplies that into the chunk's hidden-state
gradient and adds it to the weight gradient (accumulated in float32), then drops the chunk's logits. This is the
idea of Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM
Training"): with the gradients taken in the forward pass, backward only scales them by the incoming gradient, so the
logits are computed once (three matmuls in all, as unfused) instead of being recomputed in backward (four). The
price is that the output must be a scalar: a per-token or per-sequence loss (DPO) needs the logits again once its
gradient is known, so flame refuses the fused loss for DPO (flame/parallelize/checks.py). At most one chunk of
logits, in float32 plus one copy in the matmul dtype, is alive at a time; the gradients (hidden-sized and
weight-sized, float32 for the weight) wait for backward instead.

On CUDA tensors the dispatch table (flame/ops/dispatch.py) serves the call with Liger-Kernel's Triton kernel where
``liger-kernel`` is installed (the ``liger`` extra; 1.66x faster than the unfused loss and 3.2x faster than this
implementation on an H100, docs/performance.md "Fused linear cross-entropy"), with its z-loss
(``lse_square_scale``) and its weight gradient accumulated in float32 as here; it refuses float64 and flame's
L2-warp. Otherwise this implementation serves it, or FLA 0.6.0's ``fused_linear_cross_entropy_loss``
(``fla.modules.FusedLinearCrossEntropyLoss``; Triton, the same Liger-style forward) when pinned to ``fla``: with
reduction "sum" and no label smoothing, logit scale or softcapping it computes the same summed cross-entropy; it
has no z-loss, so it refuses a call with z_loss > 0, which the PyTorch implementation then serves.
"""

import math

import torch

from flame.loss import l2_warp_pull
from flame.ops import dispatch


def default_chunk_size(tokens: int, vocab_size: int, hidden_size: int) -> int:
    """Liger-Kernel's rule: as many chunks as the vocabulary is wider than the hidden size, so that one chunk of
    logits is about as large as the hidden states; a power of two."""
    chunks = max(1, math.ceil(vocab_size / hidden_size))
    return 1 << max(0, math.ceil(tokens / chunks) - 1).bit_length()


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    chunk_size: int,
    with_grads: bool,
    l2warp: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed cross-entropy and z-term of ``hidden`` [N, H] @ ``weight.T`` [H, V] against ``labels`` [N], chunk by
    chunk; with ``with_grads`` also the gradients of cross_entropy + z_loss x z_term w.r.t. hidden and weight, with
    ``l2warp``'s pull on each position's largest logit added (flame/loss.py's ``l2_warp``)."""
    accumulate = _softmax_dtype(hidden.dtype)
    if with_grads and l2warp > 0:
        pull = l2_warp_pull(labels, l2warp, accumulate, ignore_index)
    cross_entropy = torch.zeros((), dtype=accumulate, device=hidden.device)
    z_term = torch.zeros((), dtype=accumulate, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grads else None
    grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if with_grads else None
    for start in range(0, hidden.shape[0], chunk_size):
        chunk_hidden = hidden[start : start + chunk_size]
        chunk_labels = labels[start : start + chunk_size]
        labelled = chunk_labels != ignore_index
        targets = torch.where(labelled, chunk_labels, 0)
        # The matmul in the input dtype as lm_head computes it, the softmax in float32 (loss.py's rule).
        logits = (chunk_hidden @ weight.T).to(accumulate)
        lse = logits.logsumexp(-1)
        target_logits = logits.gather(1, targets[:, None]).squeeze(1)
        cross_entropy += torch.where(labelled, lse - target_logits, 0).sum()
        if z_loss > 0:
            z_term += torch.where(labelled, lse.square(), 0).sum()
        if not with_grads:
            continue
        if l2warp > 0:
            top, top_index = logits.max(-1, keepdim=True)
        # d/dlogits of (lse - logit_y) + z_loss lse^2 = softmax x (1 + 2 z_loss lse) - onehot(y), labelled rows
        # only. In place: the float32 logits become their gradient.
        grad_logits = logits.sub_(lse[:, None]).exp_()
        grad_logits.mul_(torch.where(labelled, 1 + 2 * z_loss * lse, 0)[:, None])
        grad_logits.scatter_add_(1, targets[:, None], -labelled.to(accumulate)[:, None])
        if l2warp > 0:
            grad_logits.scatter_add_(1, top_index, top * pull)
        grad_logits = grad_logits.to(weight.dtype)
        grad_hidden[start : start + chunk_size] = grad_logits @ weight
        grad_weight += grad_logits.T @ chunk_hidden
    return cross_entropy, z_term, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    """Gradients taken in forward, chunk by chunk; backward scales them by the loss's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, z_loss, chunk_size, l2warp):
        cross_entropy, z_term, grad_hidden, grad_weight = _chunked_loss(
            hidden, weight, labels, ignore_index, z_loss, chunk_size, with_grads=True, l2warp=l2warp
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(cross_entropy, z_term)
        return cross_entropy + z_loss * z_term, cross_entropy, z_term

    @staticmethod
    def backward(ctx, grad_loss, _grad_cross_entropy, _grad_z_term):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype),
            (grad_weight * grad_loss.to(grad_weight.dtype)).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    chunk_size: int,
    l2warp: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flame's PyTorch implementation (the CPU path and the reference); hidden [N, H], weight [V, H], labels [N]."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, z_loss, chunk_size, l2warp)
    cross_entropy, z_term, _, _ = _chunked_loss(
        hidden, weight, labels, ignore_index, z_loss, chunk_size, with_grads=False
    )
    return cross_entropy + z_loss * z_term, cross_entropy, z_term


def fla_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    chunk_size: int,
    l2warp: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLA 0.6.0's Triton fused linear cross-entropy (summed), imported on first use."""
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

    # FLA takes a chunk count (and rounds the chunk size up to a power of two).
    loss = fused_linear_cross_entropy_loss(
        hidden,
        labels,
        weight,
        ignore_index=ignore_index,
        num_chunks=math.ceil(hidden.shape[0] / chunk_size),
        reduction="sum",
    )
    return loss, loss.detach(), torch.zeros_like(loss.detach())


def liger_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    chunk_size: int,
    l2warp: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Liger-Kernel's Triton fused linear cross-entropy (summed; it picks its own chunks), imported on first use."""
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss(
        ignore_index=ignore_index,
        lse_square_scale=z_loss,
        reduction="sum",
        return_z_loss=True,
        accum_dtype=torch.float32,  # the weight gradient summed over the chunks in float32, as flame's
    )
    output = liger(weight, hidden, labels)
    # Liger's z_loss is lse_square_scale x the summed logsumexp^2, part of its loss.
    z_part = output.z_loss.detach().float()
    z_term = z_part / z_loss if z_loss > 0 else torch.zeros_like(z_part)
    return output.loss, output.loss.detach() - z_part.to(output.loss.dtype), z_term


def liger_refuses(hidden, weight, labels, ignore_index, z_loss, chunk_size, l2warp) -> str | None:
    if hidden.dtype == torch.float64:
        return "has no float64 kernel"
    return "takes flame's L2-warp in flame's implementation" if l2warp > 0 else None


def fla_refuses(hidden, weight, labels, ignore_index, z_loss, chunk_size, l2warp) -> str | None:
    if z_loss > 0:
        return "has no z-loss"
    # FLA's use_l2warp divides by the positions of a mean loss; flame's sums take flame's L2-warp.
    return "takes flame's L2-warp in flame's implementation" if l2warp > 0 else None


LINEAR_CROSS_ENTROPY = dispatch.register_op(
    "linear_cross_entropy",
    linear_cross_entropy_torch,
    {
        "liger": dispatch.Backend(
            liger_linear_cross_entropy,
            refuses=liger_refuses,
            requires=("liger_kernel",),
            code=("liger_kernel.",),
        ),
        "torch": linear_cross_entropy_torch,
        "fla": dispatch.Backend(
            fla_linear_cross_entropy,
            refuses=fla_refuses,
            requires=("fla",),
            code=("fla.modules.fused_linear_cross_entropy.",),
        ),
    },
)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    l2warp: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross_entropy + z_loss x z_term, cross_entropy, z_term) of the logits ``hidden @ weight.T`` against
    ``labels``, summed over the tokens whose label is not ``ignore_index``; hidden [..., H], weight [V, H],
    labels [...] (already shifted). ``l2warp`` > 0 adds flame/loss.py's ``l2_warp`` to the gradients.
    ``chunk_size`` tokens per chunk (default: :func:`default_chunk_size`). Under autocast the matmuls run in the
    autocast dtype, as lm_head's would."""
    hidden = hidden.flatten(0, -2)
    labels = labels.flatten()
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden states but {labels.shape[0]} labels")
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0], weight.shape[1])
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        return LINEAR_CROSS_ENTROPY(hidden, weight, labels, ignore_index, z_loss, chunk_size, l2warp)
