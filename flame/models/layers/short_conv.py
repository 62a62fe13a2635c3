"""Causal depthwise short convolution over time, the q/k/v "short conv" of DeltaNet and Gated DeltaNet.

An ``nn.Conv1d`` subclass, as FLA's ``ShortConvolution`` is: the weight is [D, 1, W] under the name ``weight``, so
state dicts map 1:1, and the generic initialisation (normal for ``nn.Conv1d``) covers it. The forward takes
[B, T, D] and runs ``flame.ops.short_conv.short_conv`` (flame's Triton kernel on CUDA, PyTorch elsewhere), which keeps
packed documents (``cu_seqlens``) from seeing each other. ``convolve_together`` runs a layer's convolutions (DeltaNet's
q, k and v) as one call of the op where it can.
"""

from collections.abc import Sequence

import torch
from torch import nn

from flame.models.layers.sharding import local_param
from flame.ops.context_parallel import active_group, previous_tokens, window_cu_seqlens
from flame.ops.short_conv import short_conv, short_conv_group


class ShortConvolution(nn.Conv1d):
    def __init__(self, hidden_size: int, kernel_size: int, activation: str | None = "silu"):
        super().__init__(
            hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1, bias=False
        )
        self.activation = activation

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, past_inputs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``past_inputs`` [B, P, D]: the inputs before x (incremental decoding), which x's first outputs see."""
        weight, bias = local_param(self, "weight"), local_param(self, "bias")
        width = self.kernel_size[0]
        if past_inputs is not None:
            if cu_seqlens is not None:
                raise ValueError("past_inputs continue one sequence per row; they do not go with cu_seqlens")
            y = short_conv(torch.cat([past_inputs, x], dim=1), weight, bias, activation=self.activation)
            return y[:, past_inputs.shape[1] :]
        previous = previous_tokens(x, width - 1)
        if previous is None:
            return short_conv(x, weight, bias, activation=self.activation, cu_seqlens=cu_seqlens)
        # Context parallelism: convolve this rank's slice together with the tokens before it, keep its outputs.
        # With packed documents the window's own boundaries keep earlier documents' tokens out.
        window = window_cu_seqlens(x.shape[1], width - 1, x.device)
        if (window is None) != (cu_seqlens is None):
            raise ValueError(
                "packed documents under context parallelism need both this slice's cu_seqlens and the whole "
                "row's, given to sequence_sharded"
            )
        y = short_conv(
            torch.cat([previous, x], dim=1), weight, bias, activation=self.activation, cu_seqlens=window
        )
        return y[:, width - 1 :]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"


def convolve_together(
    convs_and_inputs: Sequence[tuple[ShortConvolution, torch.Tensor]], cu_seqlens: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """``conv(x, cu_seqlens)`` for each (conv, x), in order. Without context parallelism (nothing comes before the
    tokens) they go to ``short_conv_group``: on a GPU one launch of each of flame's kernels for DeltaNet's q, k and v
    instead of three (those that share an activation), the same results bit for bit in one launch setting."""
    if active_group() is not None:
        return [conv(x, cu_seqlens) for conv, x in convs_and_inputs]
    members = [
        (x, local_param(conv, "weight"), local_param(conv, "bias"), conv.activation)
        for conv, x in convs_and_inputs
    ]
    return short_conv_group(members, cu_seqlens)
