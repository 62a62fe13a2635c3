"""Gated DeltaNet mixer (Yang, Kautz & Hatamizadeh, arXiv 2412.06464), as FLA 0.6.0's ``fla.layers.GatedDeltaNet``.

Per token, with q/k heads H of size K and value heads HV (a multiple of H, "grouped value heads") of size V:

    q, k, v = silu(short_conv(W_q x)), silu(short_conv(W_k x)), silu(short_conv(W_v x))
    g    = -exp(A_log) * softplus(W_a x + dt_bias)        log decay per value head (Mamba2-style)
    beta = sigmoid(W_b x), times 2 with allow_neg_eigval  (eigenvalues of the transition in [-1, 1], arXiv 2411.12537)
    o    = gated delta rule over l2norm(q), l2norm(k), v   (flame.ops.gated_delta_rule)
    y    = W_o( RMSNorm(o) * silu(W_g x) )   or  W_o( RMSNorm(o) )  without the output gate (use_gate=False)

The gate, beta and l2 normalisation are left to the op ("in kernel"), as FLA 0.6.0 does. Module and parameter
names (q_proj, k_proj, v_proj, a_proj, b_proj, A_log, dt_bias, q_conv1d/k_conv1d/v_conv1d, g_proj, o_norm, o_proj)
and shapes are FLA's, so state dicts map 1:1.
"""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from flame.models.layers.decoding import MixerCache, convolve, current_token_mask, zero_padded
from flame.models.layers.norm import GatedRMSNorm, RMSNorm
from flame.models.layers.sharding import local_param
from flame.models.layers.short_conv import ShortConvolution, convolve_together
from flame.ops.context_parallel import relay_state
from flame.ops.gated_delta_rule import chunk_gated_delta_rule, gdn_gate

# Decay initialisation of Mamba2, which FLA's GatedDeltaNet copies: A = exp(A_log) ~ U(0, 16); the step size
# dt = softplus(dt_bias) log-uniform in [1e-3, 0.1], floored at 1e-4.
A_INIT_MAX = 16.0
DT_MIN, DT_MAX, DT_INIT_FLOOR = 1e-3, 0.1, 1e-4


def output_norm(head_v_dim: int, use_gate: bool, eps: float, activation: str = "swish") -> nn.Module:
    """The per-head output norm of DeltaNet-style mixers: gated by g_proj with the output gate, plain otherwise."""
    return GatedRMSNorm(head_v_dim, eps, activation) if use_gate else RMSNorm(head_v_dim, eps)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        expand_v: float = 2.0,
        use_gate: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-5,
        output_gate_activation: str = "swish",
    ):
        super().__init__()
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads or num_heads
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = num_heads * head_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.use_gate = use_gate
        self.use_short_conv = use_short_conv
        self.allow_neg_eigval = allow_neg_eigval

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = output_norm(self.head_v_dim, use_gate, norm_eps, output_gate_activation)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A_log and dt_bias only; projections, convs and the norm are initialised by the model's generic pass."""
        self.A_log.uniform_(0.0, A_INIT_MAX).log_()
        dt = self.dt_bias.uniform_(math.log(DT_MIN), math.log(DT_MAX)).exp_().clamp_(min=DT_INIT_FLOOR)
        # Inverse softplus, so that softplus(dt_bias) = dt: log(exp(dt) - 1) written stably.
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: MixerCache | None = None,
    ) -> torch.Tensor:
        """``attention_mask`` [B, Tpast + T] (1 = real token) and ``cache`` (continued and updated) are for inference:
        flame.models.layers.decoding."""
        if attention_mask is not None or cache is not None:
            return self._forward_decoding(x, attention_mask, cache)
        # position_ids are not needed: only document boundaries (cu_seqlens) matter to convolutions and recurrence.
        batch, seq_len, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            q, k, v = convolve_together(
                ((self.q_conv1d, q), (self.k_conv1d, k), (self.v_conv1d, v)), cu_seqlens
            )
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        v = v.view(batch, seq_len, -1, self.head_v_dim)
        # Under context parallelism the recurrence starts from the previous rank's state (relay_state).
        o = relay_state(
            partial(
                chunk_gated_delta_rule,
                use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=self.allow_neg_eigval,
                # FLA's layer asks for the value-first state layout; passing it keeps the CUDA path on the exact
                # kernel configuration FLA's model runs.
                state_v_first=True,
                use_gate_in_kernel=True,
            ),
            (batch, v.shape[2], self.head_v_dim, self.head_dim),  # value-first, local heads under TP
            q=q.view(batch, seq_len, -1, self.head_dim),
            k=k.view(batch, seq_len, -1, self.head_dim),
            v=v,
            g=self.a_proj(x),
            beta=self.b_proj(x),
            cu_seqlens=cu_seqlens,
            A_log=local_param(self, "A_log"),
            dt_bias=local_param(self, "dt_bias"),
        )
        if self.use_gate:
            o = self.o_norm(o, self.g_proj(x).view(batch, seq_len, -1, self.head_v_dim))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(batch, seq_len, -1))

    def _forward_decoding(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None, cache: MixerCache | None
    ) -> torch.Tensor:
        """The forward from a cached state and/or with padded tokens that change nothing. The gate and beta are
        computed here rather than in the op so that padded tokens can get g = 0 (no decay) and beta = 0 (no write)."""
        batch, seq_len, _ = x.shape
        mask = current_token_mask(attention_mask, seq_len)
        q, k, v = (zero_padded(proj(x), mask) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.use_short_conv:
            q = convolve(self.q_conv1d, q, cache, "q")
            k = convolve(self.k_conv1d, k, cache, "k")
            v = convolve(self.v_conv1d, v, cache, "v")
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        g = zero_padded(gdn_gate(self.a_proj(x), self.A_log, self.dt_bias), mask)
        beta = self.b_proj(x).float().sigmoid() * (2 if self.allow_neg_eigval else 1)
        o, state = chunk_gated_delta_rule(
            q=q.view(batch, seq_len, -1, self.head_dim),
            k=k.view(batch, seq_len, -1, self.head_dim),
            v=v.view(batch, seq_len, -1, self.head_v_dim),
            g=g,
            beta=zero_padded(beta, mask),
            initial_state=None if cache is None else cache.recurrent,
            output_final_state=cache is not None,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
        )
        if cache is not None:
            cache.recurrent = state
        if self.use_gate:
            o = self.o_norm(o, self.g_proj(x).view(batch, seq_len, -1, self.head_v_dim))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(batch, seq_len, -1))
