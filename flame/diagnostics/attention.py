"""Attention-sink and sparsity statistics of each attention layer, from the queries and keys its kernel receives.

The weights are rebuilt from each call's q and k (after RoPE, QK-norm and query scaling) with the functions of
flame.ops.attention: softmax, ``softpick_weights`` or ``rectified_softmax_weights`` over the keys
``visibility_mask`` lets each query see (causal, sliding window, documents of a packed batch). A weight of a key the
query cannot see is 0 and counts nowhere. For each layer l and query head h:

- first-token attention a_lh: the mean, over the batch and over query positions i >= 1, of the weight query i puts
  on key 0 (in a packed batch: on the first token of the query's document, and document starts are left out).
  Query 0 is left out because it sees only itself: softmax gives it weight 1 on key 0 whatever the head does. A
  query whose sliding window no longer reaches key 0 puts weight 0 on it.
- sink head: a_lh > threshold (0.3 by default), the definition of Gu et al., "When Attention Sink Emerges in
  Language Models" (ICLR 2025), that the softpick paper (arXiv 2504.20966) reports as "sink rate": the fraction of
  (attention layer, head) pairs that are sink heads.
- sparsity: over all visible (query, key) pairs of all heads, the fraction whose weight is exactly 0 (softpick and
  rectified softmax produce true zeros; softmax never does, except by float32 underflow) and, separately, the
  fraction below ``near_zero`` (1e-3 by default).

Each call's weights are built for one (sequence, head) at a time and reduced at once to running sums, so that at
most one [T, T] map exists at any time.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from flame.models.layers.attention import Attention
from flame.ops.attention import (
    observe_attention,
    rectified_softmax_weights,
    softpick_weights,
    visibility_mask,
)
from flame.ops.varlen import document_ids_and_positions

SINK_THRESHOLD = 0.3
NEAR_ZERO = 1e-3


def head_weights(
    q: torch.Tensor, k: torch.Tensor, impl: str, visible: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention weights [Tq, Tk] of one head (q [Tq, D], k [Tk, D]) in float32 (float64 for float64 inputs),
    0 where ``visible`` is False, as flame.ops.attention.reference_attention applies them."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(dtype) @ k.to(dtype).T) * scale
    if impl == "softmax":
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        return scores.softmax(-1)
    if impl == "softpick":
        return softpick_weights(scores, visible)
    if impl == "rectified":
        return rectified_softmax_weights(scores, visible)
    raise ValueError(f"impl must be softmax, softpick or rectified, got {impl!r}")


@dataclass
class LayerAttention:
    """Running sums of one attention layer's statistics (see the module docstring)."""

    description: str
    first_token_sum: (
        torch.Tensor
    )  # [H] float64: sum over the counted queries of the weight on the first token
    queries: int = 0  # counted queries per head
    visible: int = 0  # visible (query, key) pairs, all heads
    zero: int = 0
    near_zero: int = 0

    @property
    def first_token_attention(self) -> list[float]:
        """a_lh for each head h."""
        return (self.first_token_sum / max(self.queries, 1)).tolist()

    def sink_heads(self, threshold: float = SINK_THRESHOLD) -> int:
        return sum(a > threshold for a in self.first_token_attention)

    @property
    def zero_fraction(self) -> float:
        return self.zero / max(self.visible, 1)

    @property
    def near_zero_fraction(self) -> float:
        return self.near_zero / max(self.visible, 1)


def describe_attention(module: Attention) -> str:
    """'attention (softpick)', 'attention (softmax, window 4096)' ..."""
    details = [module.score_fn] + ([f"window {module.window_size}"] if module.window_size else [])
    return f"attention ({', '.join(details)})"


def attention_layers(model: nn.Module) -> dict[int, str]:
    """{layer index: description} of the decoder layers of a flame model whose mixer is attention."""
    return {
        int(name): describe_attention(block.attn)
        for name, block in model.layers.items()
        if isinstance(block.attn, Attention)
    }


class AttentionStats:
    """An observer for ``observe_attention`` that adds each call's statistics to the layer running at the time.

    ``attached(model)`` registers the observer and a forward pre-hook on every decoder layer that tells it which
    layer runs; ``layers`` then maps each attention layer's index to its LayerAttention. Called directly (not
    attached), it adds every call to layer ``self.layer`` (0).
    """

    def __init__(self, near_zero: float = NEAR_ZERO):
        self.near_zero = near_zero
        self.layers: dict[int, LayerAttention] = {}
        self.layer = 0
        self.descriptions: dict[int, str] = {}

    @contextlib.contextmanager
    def attached(self, model: nn.Module) -> Iterator["AttentionStats"]:
        self.descriptions.update(attention_layers(model))
        handles = [
            block.register_forward_pre_hook(lambda module, args, i=int(name): setattr(self, "layer", i))
            for name, block in model.layers.items()
        ]
        try:
            with observe_attention(self):
                yield self
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        impl: str,
        causal: bool = True,
        window_size: int | None = None,
        cu_seqlens: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> None:
        batch, seq_len, num_heads, head_dim = q.shape
        group = num_heads // k.shape[2]
        scale = head_dim**-0.5 if scale is None else scale
        visible = visibility_mask(seq_len, causal, window_size, cu_seqlens, q.device)
        # Counted queries and the key each reads as its first token: key 0 for i >= 1, or in a packed batch the
        # start of the query's own document for queries that are not a document start.
        if cu_seqlens is None:
            queries = torch.arange(1, seq_len, device=q.device)
            first_keys = torch.zeros_like(queries)
        else:
            document_ids, positions = document_ids_and_positions(cu_seqlens.to(q.device))
            queries = (positions > 0).nonzero().squeeze(-1)
            first_keys = cu_seqlens.to(q.device).long()[document_ids[queries]]
        stats = self.layers.get(self.layer)
        if stats is None:
            description = self.descriptions.get(self.layer, f"attention ({impl})")
            stats = LayerAttention(description, torch.zeros(num_heads, dtype=torch.float64))
            self.layers[self.layer] = stats
        for b in range(batch):
            for h in range(num_heads):
                weights = head_weights(q[b, :, h], k[b, :, h // group], impl, visible, scale)
                stats.first_token_sum[h] += weights[queries, first_keys].double().sum().cpu()
                seen = weights if visible is None else weights[visible]
                stats.zero += int((seen == 0).sum())
                stats.near_zero += int((seen < self.near_zero).sum())
                stats.visible += seen.numel()
        stats.queries += batch * len(queries)
