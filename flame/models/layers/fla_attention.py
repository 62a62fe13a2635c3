"""FLA 0.6.0's softmax attention layers on flame's attention op, for machines without flash-attn.

``fla.layers.attn.Attention`` (FLA's transformer, samba's attention layers and every hybrid's ``attn`` layers) refuses
to be built without the flash-attn package, and ``fla.layers.bitattn.BitAttention`` (bitnet) fails at its first
forward. :class:`FLAAttention` and :class:`FLABitAttention` take the same constructor arguments and hold the same
parameters under the same names and shapes, so checkpoints and HF exports are interchangeable with FLA's layers; the
generic family builds them in place of FLA's while flash-attn is not importable (flame.compat.fla_layers_on_flame).
DeltaFormer's layer (``fla.layers.deltaformer``) has no flash-attn in its parameters, only in its op's last step:
:func:`deltaformer_attention` is that op with the last step on flame's attention
(flame.compat.fla_deltaformer_on_flame). :func:`flash_attn_func` and :func:`flash_attn_varlen_func` take
flash-attn's arguments for the causal (sliding-window) attention that FLA's rodimus, NSA, MoBA and MLA modules call
(flame.compat.FLA_FLASH_ATTN_CALLERS, fla_flash_attn_calls_on_flame).

What they reproduce of FLA's layer (each a property of FLA's code, not a choice made here):
- head_dim = hidden_size // num_heads; q/o projections hidden -> hidden, k/v hidden -> num_kv_heads * head_dim
  (grouped-query attention: query head h reads key/value head h // (num_heads // num_kv_heads)); o_proj has no bias.
- qk_norm: an RMSNorm over each head's head_dim vector, before the rotary embedding, eps 1e-5 (FLA's RMSNorm
  default), weights created in float32.
- RoPE on the whole head (rotate-half / GPT-NeoX layout, base rope_theta); angles computed in float32 and the cos/sin
  tables cast to the activations' dtype before the rotation (FLA's RotaryEmbedding caches them in q's dtype).
  Positions are the token's index in its row (``position_ids`` are not read), restarting at 0 at every document of
  ``cu_seqlens`` and continuing after the cached tokens when decoding.
- causal attention with the queries aligned to the end of the keys; window_size w: a query sees its own position and
  the w - 1 keys before it (flash-attn's window (w - 1, 0)); scale 1/sqrt(head_dim).
- ``attention_mask`` [B, T] (1 = real token, contiguous padding): padded keys are hidden and padded queries output 0.
- the key/value cache (FLA's ``Cache``, with its sliding-window trimming) and the (output, None, cache) return.
"""

import torch
from torch import nn

from flame.errors import ModelConfigError
from flame.models.layers.rotary import apply_rotary, rotary_cos_sin
from flame.ops.attention import attention, reference_attention
from flame.ops.norm import rms_norm
from flame.ops.varlen import position_ids_from_cu_seqlens

# fla.modules.RMSNorm's default eps, which FLA's attention layer does not override for its q/k norms.
FLA_QK_NORM_EPS = 1e-5


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last dimension with float32 weights (FLA's ``RMSNorm(head_dim, dtype=torch.float32)``:
    parameter ``weight``), output in the input's dtype."""

    def __init__(self, dim: int, eps: float = FLA_QK_NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class FLAAttention(nn.Module):
    """``fla.layers.attn.Attention`` (FLA 0.6.0) computed by flame's attention op (module docstring)."""

    def __init__(
        self,
        hidden_size: int = 2048,
        num_heads: int = 32,
        num_kv_heads: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        window_size: int | None = None,
        rope_theta: float | None = 10000.0,
        max_position_embeddings: int | None = None,
        layer_idx: int | None = None,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"attention num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.head_dim = hidden_size // num_heads
        if self.head_dim % 2:
            raise ModelConfigError(
                f"attention head_dim = hidden_size // num_heads = {hidden_size} // {num_heads} = {self.head_dim} is "
                "odd and RoPE rotates pairs of channels; choose num_heads that gives an even head_dim"
            )
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm
        self.window_size = window_size
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.layer_idx = layer_idx
        self.build_projections()
        if qk_norm:
            self.q_norm = HeadRMSNorm(self.head_dim)
            self.k_norm = HeadRMSNorm(self.head_dim)

    def build_projections(self) -> None:
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=self.qkv_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.kv_dim, bias=self.qkv_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.kv_dim, bias=self.qkv_bias)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of q and k [B, T, H, D] at positions [B, T] (or [1, T]); the tables in q's dtype as FLA caches them."""
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        output_attentions: bool = False,
        use_cache: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, None, object]:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                "attention_mask must be [batch_size, seq_len] with 0 at padded tokens, got shape "
                f"{tuple(attention_mask.shape)}"
            )
        batch, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, q_len, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, q_len, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)

        cu_seqlens = kwargs.get("cu_seqlens")
        offset = 0
        cached_len = 0 if past_key_values is None else past_key_values.get_seq_length(self.layer_idx)
        if past_key_values is not None:
            offset = cached_len
            if cu_seqlens is None and attention_mask is not None:
                # Left-padded rows: each row's tokens continue after its own real tokens, not after the padding.
                offset = cached_len + attention_mask.sum(-1) - attention_mask.shape[-1]
        if cu_seqlens is not None:
            positions = position_ids_from_cu_seqlens(cu_seqlens).unsqueeze(0)
        elif isinstance(offset, torch.Tensor):
            positions = offset.reshape(-1, 1) + torch.arange(q_len, device=q.device)
        else:
            # From a Python int without a host-to-device copy, which a CUDA graph capture refuses.
            positions = torch.arange(offset, offset + q_len, device=q.device).unsqueeze(0)
        q, k = self.rotate(q, k, positions)

        if past_key_values is not None:
            k, v = self.read_cache(past_key_values, k, v, cached_len, q_len, cu_seqlens, attention_mask)

        if cu_seqlens is None and attention_mask is not None:
            real = (
                attention_mask.bool()
            )  # keys: its last k.shape[1] columns (the cache may hold only a window)
            o = reference_attention(
                q, k, v, impl="softmax", window_size=self.window_size, key_mask=real[:, -k.shape[1] :]
            )
            o = o * real[:, -q_len:, None, None]  # padded queries output 0, as FLA's unpad/pad does
        else:
            o = attention(
                q, k, v, impl="softmax", causal=True, window_size=self.window_size, cu_seqlens=cu_seqlens
            )
        return self.o_proj(o.reshape(batch, q_len, -1)), None, past_key_values

    def read_cache(self, past_key_values, k, v, cached_len, q_len, cu_seqlens, attention_mask):
        """Appends this call's keys/values to FLA's cache and returns the keys/values the queries read."""
        if cu_seqlens is not None and cached_len > 0:
            raise ValueError("cu_seqlens cannot be given while the key/value cache holds tokens")
        earlier = past_key_values[self.layer_idx]["attn_state"] if cached_len > 0 else None
        cached_k, cached_v = past_key_values.update(
            attn_state=(k.flatten(-2), v.flatten(-2)),
            layer_idx=self.layer_idx,
            offset=q_len,
            cache_kwargs={"window_size": self.window_size},
        )["attn_state"]
        if self.window_size is not None and q_len > 1 and attention_mask is None and earlier is not None:
            # The cache keeps only the last window_size tokens; a chunk of several queries also needs the
            # window_size - 1 keys before its first one, so it reads the cache as it was before this update.
            k = torch.cat([earlier[0].unflatten(-1, (-1, self.head_dim)), k], dim=1)
            v = torch.cat([earlier[1].unflatten(-1, (-1, self.head_dim)), v], dim=1)
            span = self.window_size + q_len - 1
            return k[:, -span:], v[:, -span:]
        if cached_len > 0:
            return cached_k.unflatten(-1, (-1, self.head_dim)), cached_v.unflatten(-1, (-1, self.head_dim))
        return k, v


class FLABitAttention(FLAAttention):
    """``fla.layers.bitattn.BitAttention`` (FLA 0.6.0, bitnet): FLAAttention with FLA's ternary-weight
    ``FusedBitLinear`` projections (a Triton kernel: GPU only), no projection bias and no qk-norm."""

    def __init__(
        self,
        hidden_size: int = 2048,
        num_heads: int = 32,
        num_kv_heads: int | None = None,
        window_size: int | None = None,
        rope_theta: float = 10000.0,
        max_position_embeddings: int | None = None,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
    ):
        super().__init__(
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            window_size=window_size,
            rope_theta=rope_theta,
            max_position_embeddings=max_position_embeddings,
            layer_idx=layer_idx,
        )

    def build_projections(self) -> None:
        from fla.modules.fused_bitlinear import FusedBitLinear

        self.q_proj = FusedBitLinear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = FusedBitLinear(self.hidden_size, self.kv_dim, bias=False)
        self.v_proj = FusedBitLinear(self.hidden_size, self.kv_dim, bias=False)
        self.o_proj = FusedBitLinear(self.hidden_size, self.hidden_size, bias=False)


def deltaformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    C: int | None = None,
) -> torch.Tensor:
    """``fla.ops.deltaformer.deltaformer_attn`` (FLA 0.6.0) with its last step on flame's attention: FLA's
    ParallelDeltaformerFunction gives u ([B, T, H, D]), then causal softmax attention of q over (k, u) with scale
    1/sqrt(D), where FLA calls flash-attn. ``attention_mask`` [B, T] (1 = real token, contiguous padding): u is FLA's
    over the padded rows, padded keys are hidden and padded queries output 0, as FLA's unpad/pad does."""
    from fla.ops.deltaformer.parallel import BLOCK_SIZE_C, ParallelDeltaformerFunction

    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(
            f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`. "
            "Please flatten variable-length inputs before processing."
        )
    chunk = min(BLOCK_SIZE_C if C is None else C, k.shape[1])
    u = ParallelDeltaformerFunction.apply(q, k, v, beta, chunk, cu_seqlens)
    if attention_mask is not None:  # FLA's order: the mask before cu_seqlens
        real = attention_mask.bool()
        return reference_attention(q, k, u, impl="softmax", key_mask=real) * real[:, :, None, None]
    return attention(q, k, u, impl="softmax", causal=True, cu_seqlens=cu_seqlens)


def flash_window(window_size: tuple[int, int], causal: bool) -> int | None:
    """flash-attn's (left, right) window as flame's: the keys a query sees, its own included; None for no window.
    Causal attention sees no key to the right whatever ``right`` says (as in flash-attn)."""
    left, right = window_size
    if causal:
        return None if left < 0 else left + 1
    if left < 0 and right < 0:
        return None
    raise ValueError(
        f"flame's attention runs a sliding window only with causal=True, got window_size {window_size}"
    )


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    **unsupported,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_func`` (q [B, Tq, H, D], k/v [B, Tk, HKV, D], a causal sliding window
    (left, 0)) on flame's attention, for FLA layers that call it in their forward
    (flame.compat.fla_flash_attn_calls_on_flame)."""
    check_flash_arguments(dropout_p, unsupported)
    return attention(
        q,
        k,
        v,
        impl="softmax",
        causal=causal,
        window_size=flash_window(window_size, causal),
        scale=softmax_scale,
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    **unsupported,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func`` (documents packed along the first dimension: q [total, H, D]) on
    flame's attention, where the queries and the keys are the same documents (training's packed batches)."""
    check_flash_arguments(dropout_p, unsupported)
    if cu_seqlens_q.shape != cu_seqlens_k.shape or not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise ValueError("flame's attention runs packed documents whose queries and keys are the same tokens")
    window = flash_window(window_size, causal)
    return attention(
        q[None], k[None], v[None], impl="softmax", causal=causal, window_size=window, cu_seqlens=cu_seqlens_q,
        scale=softmax_scale,
    )[0]  # fmt: skip


def check_flash_arguments(dropout_p: float, unsupported: dict) -> None:
    if dropout_p:
        raise ValueError(f"flame's attention has no dropout, got dropout_p {dropout_p}")
    # flash-attn's defaults: no ALiBi slopes, no softcap, no deterministic flag, no attention probabilities back.
    given = [
        name
        for name, value in unsupported.items()
        if torch.is_tensor(value) or value not in (None, False, 0.0)
    ]
    if given:
        raise ValueError(f"flame's attention does not take flash-attn's {', '.join(sorted(given))}")
