"""FLA 0.6.0's Mamba2 layer with its training scan on flame's chunked SSD, for machines without mamba_ssm.

``fla.layers.mamba2.Mamba2`` runs mamba_ssm's and causal_conv1d's kernels where they import (the package index has
no wheels of them) and otherwise ``torch_forward``, whose scan materialises a state-sized product for every pair of
tokens in a chunk: a 97M Mamba2 ran out of an H200's 140 GiB in its first step at 8 x 2048 tokens. :class:`FLAMamba2`
is FLA's class (same constructor, parameters and cache path) whose ``torch_forward`` computes a forward without a
cache (training) or starting one (a prompt's prefill) with flame.ops.ssd: the in-projection, the short convolution
and activation, the SSD scan, the D skip, the gated RMSNorm and the out-projection, each as FLA's code does them,
and with a cache the convolution's inputs and the scan's last state as FLA keeps them; documents packed into one row
(``cu_seqlens``, no cache) each alone, the convolution as flame's short conv (flame.ops.short_conv), which starts
each document from zeros. Decoding token by token from the cache stays FLA's. The generic family builds it in place
of FLA's layer while mamba_ssm's fast path is missing (flame.compat.fla_layers_on_flame).

Heads share B and C in ``n_groups`` groups of consecutive heads (head h reads group h // (heads / n_groups)), as
mamba_ssm's kernels and FLA's own decoding step do; FLA's ``torch_forward`` over a whole sequence tiles the groups
instead (head h reads group h % n_groups), so the two agree for the default ``n_groups`` 1 only, and a prefill here
continues consistently into FLA's decoding step for any ``n_groups``.
"""

import torch
import torch.nn.functional as F
from fla.layers.mamba2 import Mamba2, apply_mask_to_padding_states

from flame.models.layers.fla_packed_documents import PackedDocumentsWithoutCache
from flame.ops.short_conv import short_conv
from flame.ops.ssd import ssd


class FLAMamba2(PackedDocumentsWithoutCache, Mamba2):
    def torch_forward(
        self, input_states, last_state=None, use_cache: bool = False, attention_mask=None, cu_seqlens=None
    ):
        if last_state is not None:
            return super().torch_forward(input_states, last_state, use_cache, attention_mask)
        batch, length, _ = input_states.shape
        dtype = input_states.dtype
        projected = self.in_proj(input_states)
        groups_width = self.n_groups * self.ssm_state_size
        d_mlp = (projected.shape[-1] - 2 * self.intermediate_size - 2 * groups_width - self.num_heads) // 2
        _, _, gate, x_B_C, dt = torch.split(
            projected, [d_mlp, d_mlp, self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        x_B_C = apply_mask_to_padding_states(x_B_C, attention_mask)
        conv_state = None
        if use_cache:  # the last conv_kernel_size inputs of the convolution, left-padded with zeros
            conv_state = F.pad(x_B_C.transpose(1, 2), (self.conv_kernel_size - length, 0))
        if cu_seqlens is None:
            x_B_C = self.act(self.conv1d(x_B_C.transpose(1, 2))[..., :length].transpose(1, 2))
        else:  # each document's convolution starts from zeros
            x_B_C = self.act(short_conv(x_B_C, self.conv1d.weight, self.conv1d.bias, cu_seqlens=cu_seqlens))
        if attention_mask is not None and attention_mask.shape == x_B_C.shape[:2]:
            x_B_C = (x_B_C * attention_mask[:, :, None]).to(x_B_C.dtype)
        x, B, C = torch.split(x_B_C, [self.intermediate_size, groups_width, groups_width], dim=-1)

        dt = torch.clamp(F.softplus(dt + self.dt_bias), self.dt_limit[0], self.dt_limit[1]).float()
        A = -torch.exp(self.A_log.float())
        x = x.reshape(batch, length, self.num_heads, self.head_dim).float()
        per_group = self.num_heads // self.n_groups
        B, C = (
            t.reshape(batch, length, self.n_groups, self.ssm_state_size)
            .float()
            .repeat_interleave(per_group, dim=2)
            for t in (B, C)
        )
        y, ssm_state = ssd(x, dt, A, B, C, cu_seqlens=cu_seqlens)
        y = (y + x * self._get_D(expand_to_head_dim=True)).reshape(batch, length, -1)
        scan_output = self.norm(y, gate) if self.rmsnorm else y * self.act(gate)
        return self.out_proj(scan_output.to(dtype)), conv_state, ssm_state

    sequence_forward = torch_forward
