"""Query scaling of the "scaled" attention variants (Scalable-Softmax style, see the softpick paper's appendix).

    q'[b, t, h] = q[b, t, h] * head_scale[h] * log(t + 2)

with t the query's 0-based position. Under varlen packing t is the position inside the query's document: pass
`flame.ops.varlen.position_ids_from_cu_seqlens(cu_seqlens)`. The usual 1/sqrt(d) scaling still happens inside
the attention. head_scale is a learnable [H] parameter (initialised to 0.3 by the softpick authors).
"""

import torch


def scale_queries_by_position(
    q: torch.Tensor, head_scale: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """q [B, T, H, D], head_scale [H], positions [T] or [B, T] -> q scaled, in q's dtype (computed in float32+)."""
    if positions.shape[-1] != q.shape[1]:
        raise ValueError(f"positions cover {positions.shape[-1]} tokens, q has {q.shape[1]}")
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    position_factor = torch.log(positions.to(compute_dtype) + 2)[..., :, None, None]
    return (q.to(compute_dtype) * head_scale.to(compute_dtype)[:, None] * position_factor).to(q.dtype)
