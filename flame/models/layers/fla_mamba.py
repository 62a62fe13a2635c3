"""FLA 0.6.0's Mamba layer (Mamba's first version) with its scan on flame's selective scan, for machines without
mamba_ssm.

``fla.layers.mamba.Mamba`` runs mamba_ssm's and causal_conv1d's kernels where they import (the package index has no
wheels of them) and otherwise ``slow_forward``, whose scan materialises exp(delta A) and delta B u for every token
([batch, D, T, N] each) and keeps a state per token for autograd: a 97M Mamba ran out of an H200's 140 GiB in its
first step at 8 x 2048 tokens. :class:`FLAMamba` is FLA's class (same constructor, parameters and cache path) whose
``slow_forward`` computes a forward without a cache (training) or starting one (a prompt's prefill) with
flame.ops.selective_scan: the in-projection, the convolution and activation, the selection projections, the scan,
the D skip, the gate and the out-projection, each as FLA's code does them, and with a cache the convolution's inputs
and the scan's last state as FLA keeps them; documents packed into one row (``cu_seqlens``, no cache) each alone: the
convolution as flame's short conv (flame.ops.short_conv), which starts each document from zeros, and the scan from a
zero state at each document's first token. Decoding token by token from the cache stays FLA's. The generic family
builds it in place of FLA's layer while mamba_ssm's fast path is missing (flame.compat.fla_layers_on_flame).
"""

import torch
import torch.nn.functional as F
from fla.layers.mamba import Mamba

from flame.models.layers.fla_packed_documents import PackedDocumentsWithoutCache
from flame.ops.selective_scan import selective_scan
from flame.ops.short_conv import short_conv


class FLAMamba(PackedDocumentsWithoutCache, Mamba):
    def slow_forward(self, input_states, last_state=None, use_cache: bool | None = False, attention_mask=None,
                     cu_seqlens=None, **kwargs):  # fmt: skip
        if last_state is not None:
            return super().slow_forward(input_states, last_state, use_cache, attention_mask, **kwargs)
        length = input_states.shape[1]
        dtype = input_states.dtype
        hidden_states, gate = self.in_proj(input_states).transpose(1, 2).chunk(2, dim=1)  # [batch, D, T] each
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)
        conv_state = self._build_conv_state(hidden_states) if use_cache else None
        if cu_seqlens is None:
            hidden_states = self.act(self.conv1d(hidden_states)[..., :length])
        else:  # each document's convolution starts from zeros
            convolved = short_conv(
                hidden_states.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, cu_seqlens=cu_seqlens
            )
            hidden_states = self.act(convolved.transpose(1, 2))
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)

        ssm_parameters = self.x_proj(hidden_states.transpose(1, 2))
        time_step, B, C = torch.split(
            ssm_parameters, [self.dt_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
        )
        delta = F.softplus(self.dt_proj(time_step))  # [batch, T, D]
        A = -torch.exp(self.A_log.float())
        u = hidden_states.transpose(1, 2)  # [batch, T, D]
        y, ssm_state = selective_scan(u, delta, A, B, C, cu_seqlens=cu_seqlens)
        scan_output = (y.transpose(1, 2) + hidden_states * self.D[None, :, None]) * self.act(gate)
        return self.out_proj(scan_output.transpose(1, 2)), conv_state, ssm_state.to(dtype)

    sequence_forward = slow_forward
