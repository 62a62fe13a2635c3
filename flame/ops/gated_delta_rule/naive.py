"""Token-by-token gated delta rule: the ground truth the chunked implementation and FLA's kernels are tested against.

For one value head, with the state S in FLA's default key-first layout [K, V]:

    S <- exp(g_t) * S                                 (decay; g_t <= 0 in log space)
    u_t = beta_t * (v_t - S^T k_t)                    (delta-rule correction of the value)
    S <- S + k_t u_t^T
    o_t = S^T (scale * q_t)                           (read out AFTER the update)

Grouped value heads: with HV value heads and H query/key heads (HV a multiple of H), value head hv uses q/k head
hv // (HV // H), i.e. consecutive value heads share a key head (`repeat_interleave`), as in FLA's kernels
(`i_h = i_hv // (HV // H)`). Without g the decay is skipped: this is the plain delta rule.

Layouts are FLA's: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; states [N, HV, K, V]. The recurrence runs
in float32 for half-precision inputs and in the input dtype otherwise (float64 stays float64).
"""

import torch


def _recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of equal-length sequences; returns (o [B, T, HV, V], final state [B, HV, K, V])."""
    batch, seq_len, num_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    group = num_value_heads // num_heads
    q = q.to(compute_dtype).repeat_interleave(group, dim=2) * scale
    k = k.to(compute_dtype).repeat_interleave(group, dim=2)
    v, beta = v.to(compute_dtype), beta.to(compute_dtype)

    if initial_state is None:
        state = q.new_zeros(batch, num_value_heads, key_dim, value_dim)
    else:
        state = initial_state.to(compute_dtype)
    outputs = []
    for t in range(seq_len):
        if g is not None:
            state = state * g[:, t].to(compute_dtype).exp()[..., None, None]
        correction = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * correction[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, one token at a time. g=None gives the (ungated) delta rule.

    With `cu_seqlens` (batch 1) each document is run on its own from its own initial state (initial_state[n]),
    and the final state has one entry per document. Returns (o in q.dtype, final state in the compute dtype or None).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is None:
        o, final_state = _recurrence(q, k, v, g, beta, scale, initial_state)
    else:
        boundaries = cu_seqlens.tolist()
        outputs, final_states = [], []
        for n, (bos, eos) in enumerate(zip(boundaries[:-1], boundaries[1:])):
            o_n, state_n = _recurrence(
                q[:, bos:eos],
                k[:, bos:eos],
                v[:, bos:eos],
                None if g is None else g[:, bos:eos],
                beta[:, bos:eos],
                scale,
                None if initial_state is None else initial_state[n : n + 1],
            )
            outputs.append(o_n)
            final_states.append(state_n)
        o, final_state = torch.cat(outputs, dim=1), torch.cat(final_states, dim=0)
    return o.to(q.dtype), final_state if output_final_state else None
