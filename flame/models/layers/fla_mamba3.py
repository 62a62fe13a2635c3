"""FLA 0.6.0's Mamba3 layer with its SISO and MIMO scans on flame.ops.mamba3, for machines without mamba_ssm.

``fla.layers.mamba3.Mamba3`` has one path: mamba_ssm's Mamba-3 kernels (the package index has no wheels of them),
without which its first forward raises. :class:`FLAMamba3` is FLA's class (same constructor, parameters and cache
layout) whose forward over a whole sequence (training, or a prompt's prefill) computes what FLA's calls to
``mamba3_siso_combined`` and ``mamba3_mimo`` (mamba_ssm's) compute: the in-projection and its split, the RMSNorms of B and C, A,
dt and the angles as FLA's code forms them, the scan (flame.ops.mamba3, in float32 at least, as FLA's PyTorch paths
compute their scans), the D skip, the z gate or the gated output norm (per rank, then the rank contraction, for
MIMO layers), and the out-projection; with a cache, the states mamba_ssm returns, from which ``step`` decodes token
by token in PyTorch (where FLA's step calls mamba_ssm's CuTe kernels). Packed documents (``cu_seqlens``, a row of
batch 1) are scanned each alone; batches with padding, and packed documents with a cache, are FLA's own path, which
says what it needs. The generic family builds it in place of FLA's layer while
mamba_ssm's fast path is missing (flame.compat.fla_layers_on_flame).
"""

import torch
import torch.nn.functional as F
from fla.layers.mamba3 import Mamba3
from fla.layers.utils import get_layer_cache, update_layer_cache

from flame.ops.mamba3 import mamba3_scan
from flame.ops.mamba3.naive import trapezoid_step
from flame.ops.mamba3.rotary import cumulative_angles, rotate_halves, rotate_pairs


class FLAMamba3(Mamba3):
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ):
        padded = attention_mask is not None and not bool(attention_mask.all())
        last_state = get_layer_cache(self, past_key_values)
        decoding = last_state is not None and hidden_states.shape[1] == 1
        prefill = last_state is not None and not decoding
        if padded or prefill or (cu_seqlens is not None and use_cache):
            return super().forward(
                hidden_states,
                attention_mask,
                past_key_values,
                use_cache,
                output_attentions,
                cu_seqlens,
                **kwargs,
            )
        if decoding:
            states = last_state["recurrent_state"]
            out = self.step(hidden_states, *states)
            update_layer_cache(self, past_key_values, recurrent_state=states, offset=1)
            return out, None, past_key_values
        length = hidden_states.shape[1]
        z, x, B, C, dd_dt, dd_A, trap, angles = self._project_and_split(hidden_states)
        dtype = x.dtype
        scan = torch.promote_types(dtype, torch.float32)  # float32 at least
        z, x = (torch.unflatten(t, -1, (self.num_heads, self.head_dim)) for t in (z, x))
        B, C = (
            norm(torch.unflatten(t, -1, (self.mimo_rank, self.n_groups, self.ssm_state_size)))
            for norm, t in ((self.B_norm, B), (self.C_norm, C))
        )  # [batch, T, rank, groups, state]
        dt = F.softplus(dd_dt + self.dt_bias).to(scan)  # [batch, T, heads]
        adt = self._compute_a(dd_A) * dt
        angles = angles.unsqueeze(-2).expand(-1, -1, self.num_heads, -1).to(scan)
        y, (angle_state, ssm_state, k_state, v_state) = mamba3_scan(
            C.to(scan),
            B.to(scan),
            x.to(scan),
            adt.transpose(1, 2),
            dt.transpose(1, 2),
            trap.to(scan).transpose(1, 2),
            self.C_bias.to(scan),
            self.B_bias.to(scan),
            angles,
            mimo_x=self.mimo_x.to(scan) if self.is_mimo else None,
            D=self.D.to(scan),
            pairwise=not self.is_mimo,
            cu_seqlens=cu_seqlens,
        )
        y = self.gated_and_contracted(y, z.to(scan))
        out = self.out_proj(y.to(dtype))
        if use_cache and past_key_values is not None:
            states = (angle_state, ssm_state, k_state.to(dtype), v_state.to(dtype))
            update_layer_cache(self, past_key_values, recurrent_state=states, offset=length)
        return out, None, past_key_values

    def step(self, hidden_states, angle_state, ssm_state, k_state, v_state):
        """One token from the cache, which it updates in place as FLA's step does: the recurrence of
        flame.ops.mamba3.naive for one token after FLA's own per-token preprocessing, SISO or MIMO."""
        z, x, B, C, dd_dt, dd_A, trap, angles = self._project_and_split(hidden_states.squeeze(1))
        dt, B, C, x, z, trap, A, angles = self._preprocess_step(dd_A, dd_dt, B, C, x, z, trap, angles)
        dtype, scan = x.dtype, ssm_state.dtype
        dt, A, trap, x, z = (t.to(scan) for t in (dt, A, trap, x, z))
        angle = cumulative_angles(angles[:, None], dt[:, None], start=angle_state)[:, 0]
        rotate = rotate_halves if self.is_mimo else rotate_pairs
        q, k = (
            rotate(t.to(scan) + bias.transpose(0, 1).to(scan), angle[:, None])
            for t, bias in ((C, self.C_bias), (B, self.B_bias))
        )  # [batch, rank, heads, state]
        values, previous = (t[:, None] * self.rank_projection("mimo_x", scan) for t in (x, v_state.to(scan)))
        state = trapezoid_step(ssm_state, k_state.to(scan), previous, k, values, A * dt, dt, trap)
        y = torch.einsum("bhpn,brhn->brhp", state, q) + self.D[:, None].to(scan) * values
        y = self.gated_and_contracted(y, z)
        angle_state.copy_(angle)
        ssm_state.copy_(state)
        k_state.copy_(k)
        v_state.copy_(x)
        return self.out_proj(y.to(dtype)).unsqueeze(1)

    def rank_projection(self, name: str, dtype: torch.dtype) -> torch.Tensor | int:
        """A MIMO layer's projection ``name`` (mimo_x, mimo_z, mimo_o) as [rank, heads, head_dim]; 1 for SISO layers,
        which have none."""
        return getattr(self, name).transpose(0, 1).to(dtype) if self.is_mimo else 1

    def gated_and_contracted(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each rank's scan output y [..., rank, heads, head_dim] gated by silu(z * mimo_z), or normed with that gate
        (``is_outproj_norm``), then summed over the ranks with mimo_o (MIMO layers) -> [..., heads * head_dim]."""
        gates = z.unsqueeze(-3) * self.rank_projection("mimo_z", y.dtype)
        if self.is_outproj_norm:
            y = torch.unflatten(
                self.norm(y.flatten(-2), gates.flatten(-2)), -1, (self.num_heads, self.head_dim)
            )
        else:
            y = y * F.silu(gates)
        y = (y.to(gates.dtype) * self.rank_projection("mimo_o", gates.dtype)).sum(-3)
        return y.flatten(-2)
