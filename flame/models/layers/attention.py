"""Multi-head attention mixer with GQA, RoPE, optional QK-norm, sliding window and the softpick family.

``attn_impl`` takes the names of the softpick fork of flame/FLA; the ``naive_*`` names select the same math
(flame picks the kernel per device, so there is no separate naive model).

``qk_norm_scope`` says what the q/k RMSNorms normalise: ``"head"`` each head's head_dim vector (FLA's qk_norm,
OLMo-core's ``use_head_qk_norm``; weights of width head_dim), ``"full"`` the whole projection, all heads at once
(OLMo 2/3 and transformers' OLMo hybrid; weights of width num_heads * head_dim and num_kv_heads * head_dim).
"""

import functools

import torch
from torch import nn

from flame.models.common.choices import ATTN_IMPLS, check_attn_impl, check_qk_norm_scope
from flame.models.layers.decoding import MixerCache
from flame.models.layers.norm import RMSNorm
from flame.models.layers.rotary import apply_rotary, rotary_cos_sin
from flame.models.layers.sharding import local_param
from flame.ops.attention import attention, reference_attention, scale_queries_by_position
from flame.ops.context_parallel import prefix_attention

# Initial value of the per-head query scale of the scaled variants (softpick paper, appendix).
QUERY_SCALE_INIT = 0.3


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        qk_norm_scope: str = "head",
        window_size: int | None = None,
        rope_theta: float = 10000.0,
        attn_impl: str = "parallel_attn",
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        check_attn_impl(attn_impl)
        check_qk_norm_scope(qk_norm_scope)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.window_size = window_size
        self.qk_norm_scope = qk_norm_scope
        self.rope_theta = rope_theta
        self.score_fn, self.scaled = ATTN_IMPLS[attn_impl]

        self.q_proj = nn.Linear(hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden_size, bias=False)
        if qk_norm:
            full = qk_norm_scope == "full"
            self.q_norm = RMSNorm(self.num_heads * self.head_dim if full else self.head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim if full else self.head_dim, eps=norm_eps)
        else:
            self.q_norm = self.k_norm = None
        if self.scaled:
            self.q_scale = nn.Parameter(torch.full((self.num_heads,), QUERY_SCALE_INIT))

    def reset_parameters(self) -> None:
        if self.scaled:
            nn.init.constant_(self.q_scale, QUERY_SCALE_INIT)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: MixerCache | None = None,
    ) -> torch.Tensor:
        """``attention_mask`` [B, Tpast + T] (1 = real token) hides padded keys; ``cache`` holds the keys and values
        of earlier calls, which the queries (the last positions) also read, and gets this call's appended."""
        batch, seq_len, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None and self.qk_norm_scope == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim)
        if self.q_norm is not None and self.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.scaled:
            q = scale_queries_by_position(q, local_param(self, "q_scale"), position_ids)
        if cache is not None:
            if cache.key is not None:
                k, v = torch.cat([cache.key, k], dim=1), torch.cat([cache.value, v], dim=1)
            cache.key, cache.value = k, v
        if attention_mask is not None:
            # Padded batches take the materialized path, the one that takes a per-row key mask.
            o = reference_attention(
                q, k, v, impl=self.score_fn, window_size=self.window_size, key_mask=attention_mask.bool()
            )
        elif cache is not None:
            o = attention(q, k, v, impl=self.score_fn, causal=True, window_size=self.window_size)
        else:
            # Under context parallelism this rank's queries also read the keys of earlier slices.
            attend = functools.partial(
                attention, impl=self.score_fn, causal=True, window_size=self.window_size
            )
            o = prefix_attention(q, k, v, cu_seqlens, attend)
        return self.o_proj(o.reshape(batch, seq_len, -1))
