"""Mamba-2's state-space scan (SSD) in chunks, in PyTorch on any device: the structured matrix of the Mamba-2 paper
(Dao and Gu, 2024, "Transformers are SSMs", section 6) computed as masked attention inside each chunk of
``CHUNK`` tokens plus a recurrence over the chunks' states, with matmuls only. It is the op's PyTorch implementation
(flame/ops/ssd/__init__.py dispatches); ``naive.ssd_recurrent`` is the token-by-token reference."""

import torch
import torch.nn.functional as F

from flame.ops.ssd.naive import scaled_inputs

# Tokens per chunk: the masked products take batch x heads x T x CHUNK values; the result does not depend on it.
CHUNK = 64


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor | None,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of ``naive.ssd_recurrent`` (same arguments and results), chunk by chunk, in x's dtype: y and the
    state after the last token; with ``cu_seqlens`` (packed documents in a row of batch 1) each document's scan
    alone, and the state after each document's last token [documents, heads, head_dim, state_size]."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        scans = [
            ssd_chunked(*(document(t, start, end) for t in (x, dt, A, B, C)), chunk)
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat([y for y, _ in scans], dim=1), torch.cat([state for _, state in scans])
    batch, length, heads, head_dim = x.shape
    pad = -length % chunk
    # Padding at the end: zero input adds nothing and decay exp(0) = 1 changes no earlier token.
    values, log_decay = scaled_inputs(x, dt, A)
    x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (values, B, C))
    log_decay = F.pad(log_decay, (0, 0, 0, pad))
    chunks = (length + pad) // chunk
    x, B, C = (t.reshape(batch, chunks, chunk, heads, t.shape[-1]) for t in (x, B, C))
    cumulative = log_decay.reshape(batch, chunks, chunk, heads).permute(0, 3, 1, 2).cumsum(-1)  # [b, h, c, l]

    # Inside each chunk: y_i = sum_{j <= i} exp(cum_i - cum_j) (C_i . B_j) x_j.
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    gaps = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~causal, float("-inf"))
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * torch.exp(gaps)
    y = torch.einsum("bhcls,bcshp->bclhp", scores, x)

    # Each chunk's own state at its end, then the state entering each chunk by the recurrence over chunks.
    to_end = torch.exp(cumulative[..., -1:] - cumulative)  # [b, h, c, l]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, x)
    chunk_decay = torch.exp(cumulative[..., -1])  # [b, h, c]
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    entering = []
    for c in range(chunks):
        entering.append(state)
        state = chunk_decay[:, :, c, None, None] * state + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # [b, c, h, p, n]
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, entering, torch.exp(cumulative))
    return y.reshape(batch, chunks * chunk, heads, head_dim)[:, :length], state


def document(t: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """A per-token input's tokens start:end (dim 1); per-head inputs (A [heads]) and None as they are."""
    return t if t is None or t.dim() == 1 else t[:, start:end]
