"""Materialized (O(T^2) memory) attention for the softmax / softpick / rectified family: the CPU path and the reference
GPU kernels are tested against.

Shapes: q [B, Tq, H, D], k [B, Tk, HKV, D], v [B, Tk, HKV, Dv] with H a multiple of HKV and Tk >= Tq (any Tk with
causal=False); query head h reads key/value head h // (H // HKV) (grouped-query attention, the mapping of SDPA's
enable_gqa and of FLA's parallel_attn). Scores are s_ij = scale * q_i . k_j with scale = 1/sqrt(D) by default.

Queries are aligned to the end of the keys ("bottom-right", FlashAttention-2's convention for Tq != Tk): query i
sits at position p_i = i + Tk - Tq, so with Tq == Tk p_i = i, and with Tq < Tk the queries are the last Tq
positions of the key sequence (a context-parallel rank's slice of queries against the keys up to its end). Which
keys a query sees (`visibility_mask`):
- causal: j <= p_i; with causal=False every key of the sequence (or document);
- window_size w (causal only): p_i - w < j <= p_i, i.e. the query's own position and the w - 1 keys before it. FLA's
  parallel_attn uses the same convention ("keys in [i - window_size + 1, i]");
- cu_seqlens (batch 1, Tq == Tk only): only keys of the query's own document (block-diagonal).
Every query sees at least the key at its own position, so no row is empty.

Weights per query row, over visible keys only (masked keys count nowhere, in particular not in any denominator):
- softmax: torch SDPA.
- softpick (arXiv 2504.20966): relu(e^s_i - 1) / (sum_j |e^s_j - 1| + eps e^m), computed in the shifted form
  relu(e^(s_i - m) - e^-m) / (sum_j |e^(s_j - m) - e^-m| + eps) with eps = SOFTPICK_EPS = 1e-6 added in the shifted
  space, as the flash-style softpick kernel does (its accumulator gets + eps after the last block; the softpick
  authors' Triton kernel uses 1e-6). m is the row max of the visible scores clamped at 0: rows whose max is > 0 get
  the kernel's result, rows whose scores are all <= 0 output exactly 0 either way (relu of a value <= 0), and the
  clamp keeps e^-m <= 1 so nothing overflows. Each term is evaluated with expm1, more accurately than a kernel's
  exp(s - m) - exp(-m) for scores near 0.
- rectified softmax: softmax over the visible scores s >= 0 only; a row without one outputs 0 (not NaN).
Scores and weights are computed in float32 (float64 for float64 inputs); the output has q's dtype.
"""

import torch
import torch.nn.functional as F

from flame.ops.varlen import document_ids_and_positions

IMPLS = ("softmax", "softpick", "rectified")
SOFTPICK_EPS = 1e-6


def check_query_key_lengths(query_len: int, key_len: int, causal: bool, packed: bool) -> None:
    """The length rules of every attention path: queries aligned to the end of the keys need Tk >= Tq (causal),
    packed documents (cu_seqlens) Tq == Tk."""
    if packed and key_len != query_len:
        raise ValueError(
            "cu_seqlens needs as many queries as keys (packed documents with fewer queries than keys are not "
            f"supported), got {query_len} queries, {key_len} keys"
        )
    if causal and key_len < query_len:
        raise ValueError(
            "causal attention needs at least as many keys as queries (queries are aligned to the end of the keys), "
            f"got {query_len} queries, {key_len} keys"
        )


def visibility_mask(
    seq_len: int,
    causal: bool = True,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | None = None,
    key_len: int | None = None,
) -> torch.Tensor | None:
    """[Tq, Tk] bool for seq_len = Tq queries and key_len = Tk keys (default Tq), True where query i (row) may attend
    to key j (column), queries aligned to the end of the keys (module docstring); None when every key is visible."""
    key_len = seq_len if key_len is None else key_len
    if window_size is not None and not causal:
        raise ValueError("window_size needs causal=True")
    if window_size is not None and window_size < 1:
        raise ValueError(f"window_size must be >= 1, got {window_size}")
    check_query_key_lengths(seq_len, key_len, causal, packed=cu_seqlens is not None)
    if not causal and cu_seqlens is None:
        return None
    query = torch.arange(key_len - seq_len, key_len, device=device)[:, None]
    key = torch.arange(key_len, device=device)[None, :]
    visible = torch.ones(seq_len, key_len, dtype=torch.bool, device=device)
    if causal:
        visible &= key <= query
    if window_size is not None:
        visible &= key > query - window_size
    if cu_seqlens is not None:
        if int(cu_seqlens[-1]) != seq_len:
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, the sequence has {seq_len} tokens")
        document_ids = document_ids_and_positions(cu_seqlens.to(device))[0]
        visible &= document_ids[:, None] == document_ids[None, :]
    return visible


def softpick_weights(
    scores: torch.Tensor, visible: torch.Tensor | None, eps: float = SOFTPICK_EPS
) -> torch.Tensor:
    """Softpick over the last dimension of scores [..., Tq, Tk], visible keys only (see the module docstring)."""
    # A masked key gets the score 0, for which e^0 - 1 = 0: it then adds exactly nothing to either sum.
    x = scores if visible is None else torch.where(visible, scores, 0.0)
    shift = x.amax(-1, keepdim=True).clamp(min=0)
    # p = e^(x - m) - e^-m, written as e^(x - m) * (1 - e^-x) for x > 0 and e^-m * (e^x - 1) otherwise: expm1 of a
    # non-positive argument on both sides, so no cancellation near x = 0 and no overflow. The clamps keep the branch
    # that `where` discards finite too, whose gradient would otherwise be inf * 0 = NaN.
    p = torch.where(
        x > 0,
        -torch.exp(x - shift) * torch.expm1(-x.clamp(min=0)),
        torch.exp(-shift) * torch.expm1(x.clamp(max=0)),
    )
    return torch.relu(p) / (p.abs().sum(-1, keepdim=True) + eps)


def rectified_softmax_weights(scores: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the visible non-negative scores of each row; rows without one are all zero."""
    kept = scores >= 0 if visible is None else visible & (scores >= 0)
    shift = torch.where(kept, scores, 0.0).amax(-1, keepdim=True)
    exps = torch.exp(torch.where(kept, scores - shift, float("-inf")))
    total = exps.sum(-1, keepdim=True)
    return exps / torch.where(total > 0, total, 1.0)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    impl: str,
    causal: bool = True,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the given impl ("softmax", "softpick" or "rectified"), materialized; returns [B, Tq, H, Dv].

    ``key_mask`` [B, Tk] bool (padded batches) hides the keys where it is False from every query; a query left
    without a visible key (a padded position before the first real token) outputs 0."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})")
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"a packed batch (cu_seqlens given) must have batch size 1, got {batch}")
    if scale is None:
        scale = head_dim**-0.5
    visible = visibility_mask(seq_len, causal, window_size, cu_seqlens, q.device, key_len=k.shape[1])
    empty_rows = None
    if key_mask is not None:
        if key_mask.shape != (batch, k.shape[1]):
            raise ValueError(f"key_mask must be [B, Tk] = {[batch, k.shape[1]]}, got {list(key_mask.shape)}")
        visible = key_mask[:, None, None, :] if visible is None else visible & key_mask[:, None, None, :]
        empty_rows = ~visible.any(-1, keepdim=True)
        visible = visible | empty_rows  # keeps softmax finite there; those rows are zeroed below

    # Scores and weights in float32 even under autocast (which would run the matmuls in bf16): softpick's
    # relu(e^s - 1) and |e^s - 1| flip at s = 0, where bf16 rounding of s changes the result, and a fused
    # kernel accumulates in float32 as well.
    with torch.autocast(q.device.type, enabled=False):
        out = _materialized_attention(q, k, v, impl, causal, window_size, cu_seqlens, scale, visible)
        if empty_rows is not None:
            out = out.masked_fill(empty_rows, 0.0)
    return out.transpose(1, 2).to(q.dtype)


def _materialized_attention(q, k, v, impl, causal, window_size, cu_seqlens, scale, visible) -> torch.Tensor:
    """[B, H, Tq, Dv] in float32 (float64 for float64 inputs)."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    group = num_heads // num_kv_heads
    # [B, H, T, D], key/value heads repeated for the query heads they serve.
    q_h = q.to(compute_dtype).transpose(1, 2)
    k_h = k.to(compute_dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    v_h = v.to(compute_dtype).repeat_interleave(group, dim=2).transpose(1, 2)

    if impl == "softmax":
        # SDPA's is_causal aligns the queries to the start of the keys: with Tq != Tk the mask says otherwise.
        plain_causal = (
            causal
            and window_size is None
            and cu_seqlens is None
            and q.shape[1] == k.shape[1]
            and visible.ndim == 2
        )
        out = F.scaled_dot_product_attention(
            q_h, k_h, v_h, attn_mask=None if plain_causal else visible, is_causal=plain_causal, scale=scale
        )
    else:
        scores = (q_h @ k_h.transpose(-1, -2)) * scale
        weights = (
            softpick_weights(scores, visible)
            if impl == "softpick"
            else rectified_softmax_weights(scores, visible)
        )
        out = weights @ v_h
    return out
