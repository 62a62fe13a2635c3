"""DeltaNet mixer (Schlag et al. 2021; Yang et al., arXiv 2406.06484), as FLA 0.6.0's ``fla.layers.DeltaNet``.

Per token, with H heads of key size K = hidden*expand_k/H and value size V = hidden*expand_v/H:

    q, k = phi(short_conv(W_q x)), phi(short_conv(W_k x))      phi = qk_activation (silu fused into the conv)
    q, k = l2norm(q), l2norm(k)   (in the op)  or  q/|q|_1, k/|k|_1  (qk_norm='sum')
    v    = silu(short_conv(W_v x))
    beta = sigmoid(W_b x) (1 without use_beta), times 2 with allow_neg_eigval
    o    = delta rule over q, k, v, beta                         (flame.ops.delta_rule)
    y    = W_o( RMSNorm(o) * silu(W_g x) )  with the output gate (use_gate), W_o( RMSNorm(o) ) otherwise

Like FLA's layer, sequences of at most 64 tokens go to the fused-recurrent op and longer ones to the chunked op
(both dispatchers give the same result; on CUDA they pick FLA's two kernels, and FLA's chunk kernel refuses float32).
Module and parameter names are FLA's, so state dicts map 1:1.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from flame.models.layers.decoding import MixerCache, convolve, current_token_mask, zero_padded
from flame.models.layers.gated_deltanet import output_norm
from flame.models.layers.short_conv import ShortConvolution, convolve_together
from flame.ops.context_parallel import relay_state
from flame.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

# FLA's DeltaNet switches to its fused-recurrent kernel at or below this length, in training too.
FUSED_RECURRENT_MAX_LEN = 64
# Epsilon of FLA's sum_norm (F.normalize with p=1).
SUM_NORM_EPS = 1e-6


def qk_feature_map(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The q/k activations that FLA applies after the convolution (silu is applied by the convolution itself)."""
    if activation == "relu":
        return F.relu(x)
    if activation == "elu":
        return F.elu(x) + 1  # FLA's elu_p1: keeps features positive, as in linear attention
    return x


class DeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 16,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        use_beta: bool = True,
        use_gate: bool = False,
        use_short_conv: bool = True,
        conv_size: int = 4,
        allow_neg_eigval: bool = False,
        qk_activation: str = "silu",
        qk_norm: str = "l2",
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.key_dim = round(hidden_size * expand_k)
        self.value_dim = round(hidden_size * expand_v)
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.use_beta = use_beta
        self.use_gate = use_gate
        self.use_short_conv = use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        self.qk_activation = qk_activation
        self.qk_norm = qk_norm

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if use_short_conv:
            qk_conv_activation = "silu" if qk_activation == "silu" else None
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, activation=qk_conv_activation)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, activation=qk_conv_activation)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, activation="silu")
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = output_norm(self.head_v_dim, use_gate, norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _qkv(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        mask: torch.Tensor | None = None,
        cache: MixerCache | None = None,
    ) -> tuple[torch.Tensor, ...]:
        q, k, v = (zero_padded(proj(x), mask) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.use_short_conv and cache is not None:
            return (
                convolve(self.q_conv1d, q, cache, "q"),
                convolve(self.k_conv1d, k, cache, "k"),
                convolve(self.v_conv1d, v, cache, "v"),
            )
        if self.use_short_conv:
            return tuple(
                convolve_together(((self.q_conv1d, q), (self.k_conv1d, k), (self.v_conv1d, v)), cu_seqlens)
            )
        if self.qk_activation == "silu":
            q, k = F.silu(q), F.silu(k)
        return q, k, F.silu(v)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: MixerCache | None = None,
    ) -> torch.Tensor:
        """``attention_mask`` [B, Tpast + T] (1 = real token) and ``cache`` (continued and updated) are for inference:
        flame.models.layers.decoding; padded tokens get beta = 0, so they do not write into the state."""
        # position_ids are not needed: only document boundaries (cu_seqlens) matter to convolutions and recurrence.
        batch, seq_len, _ = x.shape
        mask = current_token_mask(attention_mask, seq_len)
        q, k, v = self._qkv(x, cu_seqlens, mask, cache)
        q = qk_feature_map(q.view(batch, seq_len, -1, self.head_k_dim), self.qk_activation)
        k = qk_feature_map(k.view(batch, seq_len, -1, self.head_k_dim), self.qk_activation)
        v = v.view(batch, seq_len, -1, self.head_v_dim)
        if self.qk_norm == "sum":
            q = F.normalize(q, p=1, dim=-1, eps=SUM_NORM_EPS)
            k = F.normalize(k, p=1, dim=-1, eps=SUM_NORM_EPS)
        beta = self.b_proj(x).sigmoid() if self.use_beta else torch.ones_like(q[..., 0])
        if self.allow_neg_eigval:
            beta = beta * 2

        delta_rule = fused_recurrent_delta_rule if seq_len <= FUSED_RECURRENT_MAX_LEN else chunk_delta_rule
        if mask is not None or cache is not None:
            o, state = delta_rule(
                q,
                k,
                v,
                beta=zero_padded(beta, mask),
                initial_state=None if cache is None else cache.recurrent,
                output_final_state=cache is not None,
                use_qk_l2norm_in_kernel=self.qk_norm == "l2",
            )
            if cache is not None:
                cache.recurrent = state
        else:
            o = relay_state(
                partial(delta_rule, use_qk_l2norm_in_kernel=self.qk_norm == "l2"),
                (batch, v.shape[2], self.head_k_dim, self.head_v_dim),  # local heads under tensor parallelism
                q=q,
                k=k,
                v=v,
                beta=beta,
                cu_seqlens=cu_seqlens,
            )
        if self.use_gate:
            o = self.o_norm(o, self.g_proj(x).view(batch, seq_len, -1, self.head_v_dim))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(batch, seq_len, -1))
