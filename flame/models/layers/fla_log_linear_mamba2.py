"""FLA 0.6.0's LogLinearMamba2 layer with packed documents, and a forward off CUDA.

FLA's layer refuses ``cu_seqlens`` in its scan (``hmamba_chunk_scan_combined`` raises) and its training path passes
none, so a row of packed documents would be scanned as one sequence; its forward raises off CUDA. FLA's log-linear
op takes ``cu_seqlens`` itself. :class:`FLALogLinearMamba2` is FLA's class (same constructor, parameters and cache
path) with ``sequence_forward``: the in-projection, the short convolution and activation, the log-linear scan, the
D skip, the gated RMSNorm and the out-projection, each as FLA's training path computes them, with each document of a
packed row (``cu_seqlens``, no cache) on its own: the convolution as flame's short conv (flame.ops.short_conv), which
starts each document from zeros, and the scan given the boundaries. On CUDA the scan is FLA's chunked Triton op;
elsewhere FLA's PyTorch reference (``naive_log_linear_attn``, quadratic in a document's length), one document at a
time. A forward without ``cu_seqlens`` on CUDA, and decoding, stay FLA's. The generic family builds it in place of
FLA's layer (flame.compat.fla_layers_on_flame).
"""

import torch
import torch.nn.functional as F
from fla.layers.log_linear_mamba2 import LogLinearMamba2

from flame.models.layers.fla_packed_documents import PackedDocumentsWithoutCache
from flame.ops.short_conv import short_conv


class FLALogLinearMamba2(PackedDocumentsWithoutCache, LogLinearMamba2):
    sequence_forward_off_cuda = True

    def sequence_forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
        levels = self.num_lambda_dims
        gate, xBC, dt, dl = torch.split(
            self.in_proj(hidden_states),
            [self.intermediate_size, self.conv_dim, self.num_heads, self.num_heads * levels],
            dim=-1,
        )
        xBC = self.act(short_conv(xBC, self.conv1d.weight, self.conv1d.bias, cu_seqlens=cu_seqlens))
        groups_width = self.n_groups * self.ssm_state_size
        x, B, C = torch.split(xBC, [self.intermediate_size, groups_width, groups_width], dim=-1)
        x = x.unflatten(-1, (self.num_heads, self.head_dim))
        B, C = (t.unflatten(-1, (self.n_groups, self.ssm_state_size)) for t in (B, C))
        D = self._get_D()
        skip = x * (D[:, None] if D.dim() == 1 else D)

        dt = F.softplus(dt + self.dt_bias)
        v = (x * dt[..., None]).to(x.dtype)
        g = -torch.exp(self.A_log.float()) * dt
        # FLA's forward kernel takes the scales and the values in one tl.dot, so they share the values' dtype
        # (flame.compat.fla_log_linear_scales_in_the_inputs_dtype makes FLA's own path do the same).
        scales = F.softplus(self.L * dl.unflatten(-1, (self.num_heads, levels))).to(v.dtype)
        y = log_linear_attention(C, B, v, g, scales, cu_seqlens) + skip
        if self.rmsnorm:
            y = self.norm(y.flatten(-2), gate)
        else:
            y = (y * F.silu(gate.unflatten(-1, (self.num_heads, self.head_dim)))).flatten(-2)
        return self.out_proj(y), None, None


def log_linear_attention(q, k, v, g, level_scales, cu_seqlens):
    """FLA's log-linear attention with scale 1: its chunked op on CUDA (documents apart given ``cu_seqlens``), its
    PyTorch reference elsewhere, one document at a time."""
    if v.is_cuda:
        from fla.ops.log_linear_attn import chunk_log_linear_attn

        output, _ = chunk_log_linear_attn(q, k, v, g, level_scales, cu_seqlens=cu_seqlens, scale=1.0)
        return output
    from fla.ops.log_linear_attn.naive import naive_log_linear_attn

    if cu_seqlens is None:
        return naive_log_linear_attn(q, k, v, g, level_scales, scale=1.0).to(v.dtype)
    lengths = cu_seqlens.diff().tolist()
    documents = zip(*(t.split(lengths, dim=1) for t in (q, k, v, g, level_scales)), strict=True)
    return torch.cat([naive_log_linear_attn(*d, scale=1.0).to(v.dtype) for d in documents], dim=1)
