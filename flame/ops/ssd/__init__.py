"""Mamba-2's state-space scan (SSD), the sequence mixer of FLA's Mamba2 layer without mamba_ssm.

`ssd` dispatches on the device of x (flame/ops/dispatch.py): CUDA tensors go to FLA's chunked simple-GLA Triton
kernel, anything else to `ssd_chunked` (chunk.py, the Mamba-2 paper's chunked form in PyTorch); naive.py holds the
token-by-token recurrence both are tested against. Documents packed into one row (``cu_seqlens``) are each scanned
alone.

The scan is simple gated linear attention with a scalar decay per head and token (Yang et al., "Gated Linear
Attention Transformers", arXiv 2312.06635; the Mamba-2 paper's section 6 writes the same matrix): per head,
``S_t = exp(dt_t A) S_{t-1} + (dt_t x_t) B_t^T`` and ``y_t = S_t C_t`` are FLA's ``chunk_simple_gla`` with queries C,
keys B, values dt x, log decay g = dt A and scale 1, its state value-first ([head_dim, state_size], flame's layout).
FLA's Mamba2 layer runs mamba_ssm's kernels where they are installed and otherwise a PyTorch path that materialises
a state-sized product per pair of tokens in a chunk (24 GiB for one layer of a 97M model at 8 x 2048 tokens);
flame's layer (flame.models.layers.fla_mamba2) calls this op instead, with float32 x, B and C as FLA's PyTorch path
takes them: FLA's kernel then multiplies in TF32 (Triton's default for float32); its forward and backward run as torch.library
custom ops (one graph per compiled block), and on Hopper with Triton 3.4-3.7.0 its backward's dq/dk/dg is flame's Triton kernel, ranked there ahead of FLA's TileLang one
(flame.compat.serve_gated_dqkwg_on_hopper; tests/gpu/test_ssd.py states the errors).
"""

import torch

from flame.ops import dispatch
from flame.ops.ssd.chunk import CHUNK, ssd_chunked
from flame.ops.ssd.naive import scaled_inputs, ssd_recurrent


def fla_ssd(
    x: torch.Tensor,
    dt: torch.Tensor | None,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan on FLA 0.6.0's simple-GLA kernels through flame's custom ops (flame.ops.fla_library: FLA's
    ``chunk_simple_gla`` is a graph break under torch.compile, the ops are one node each, so a compiled Mamba2 or
    Mamba3 block is one graph); packed documents through FLA's own op, which takes their boundaries. On Hopper GPUs
    with Triton 3.4-3.7.0 its gated backward is served by flame's kernel or FLA's TileLang one (FLA issue 640)."""
    values, log_decay = scaled_inputs(x, dt, A)
    if cu_seqlens is None:
        from flame.ops.fla_library import chunk_simple_gla

        y, state = chunk_simple_gla(C, B, values.to(x.dtype), log_decay, scale=1.0, state_v_first=True)
    else:  # the custom ops take no boundaries
        from fla.ops.simple_gla import chunk_simple_gla

        from flame.ops.gated_delta_rule.dqkwg_triton import serve_where_fla_refuses

        serve_where_fla_refuses()
        y, state = chunk_simple_gla(
            C,
            B,
            values.to(x.dtype),
            g=log_decay,
            scale=1.0,
            output_final_state=True,
            state_v_first=True,
            cu_seqlens=cu_seqlens,
        )
    return y.to(x.dtype), state.to(x.dtype)


def fla_ssd_refuses(x, dt, A, B, C, cu_seqlens=None) -> str | None:
    # FLA's chunk_bwd_dv asserts even widths for 16-bit inputs (odd ones miscompile to out-of-bounds reads).
    if x.dtype in (torch.bfloat16, torch.float16) and (x.shape[-1] % 2 or B.shape[-1] % 2):
        return f"takes 16-bit inputs of even widths only, not head_dim {x.shape[-1]} x state {B.shape[-1]}"
    return None


SSD = dispatch.register_op(
    "ssd",
    ssd_chunked,
    {
        "fla": dispatch.Backend(
            fla_ssd,
            refuses=fla_ssd_refuses,
            requires=("fla",),
            code=(
                "flame.ops.fla_library.simple_gla_",
                "flame.ops.fla_library._simple_gla_",
                "fla.ops.simple_gla.",
            ),
        )
    },
)


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor | None,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [batch, T, heads, head_dim], dt [batch, T, heads] (after softplus and clamping; None: 1, x and A taken as
    they are), A [heads] (negative; or [batch, T, heads], one per token, as Mamba-3's), B and C [batch, T, heads, state_size] (one per head) -> (y [batch, T, heads, head_dim], the state after the last token
    [batch, heads, head_dim, state_size]), both in x's dtype. ``cu_seqlens``: the boundaries of documents packed into
    a row of batch 1, each scanned alone; the states are then one per document [documents, heads, head_dim,
    state_size]."""
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(
            f"packed documents (cu_seqlens) come in one row (batch 1), not a batch of {x.shape[0]}"
        )
    return SSD(x, dt, A, B, C, cu_seqlens=cu_seqlens)


__all__ = ["CHUNK", "fla_ssd", "ssd", "ssd_chunked", "ssd_recurrent"]
