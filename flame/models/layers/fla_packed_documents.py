"""Packed documents for flame's versions of FLA's Mamba, Mamba2 and LogLinearMamba2 layers, whose FLA forward ignores
or refuses ``cu_seqlens``."""

import torch
from fla.layers.utils import get_layer_cache


class PackedDocumentsWithoutCache:
    """Mixed in front of an FLA layer class: a forward given ``cu_seqlens`` runs the layer's ``sequence_forward`` (its
    training path over a whole sequence, which scans each document alone) with the boundaries; a cache with packed
    documents is refused, since FLA's decoding step carries one state per row. Without ``cu_seqlens``, FLA's forward;
    a layer whose FLA forward runs on CUDA only sets ``sequence_forward_off_cuda`` to run ``sequence_forward`` off
    CUDA as well (one document per row, without a cache or an attention mask)."""

    sequence_forward_off_cuda = False

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
        off_cuda = (
            self.sequence_forward_off_cuda and hidden_states.device.type != "cuda" and attention_mask is None
        )
        if cu_seqlens is None and not (
            off_cuda and not use_cache and get_layer_cache(self, past_key_values) is None
        ):
            return super().forward(
                hidden_states, attention_mask, past_key_values, use_cache, output_attentions, **kwargs
            )
        if use_cache or get_layer_cache(self, past_key_values) is not None:
            name = type(self).__name__.removeprefix("FLA")
            raise ValueError(f"{name} takes packed documents (cu_seqlens) without a cache only")
        output, _, _ = self.sequence_forward(hidden_states, cu_seqlens=cu_seqlens)
        return output, None, past_key_values
