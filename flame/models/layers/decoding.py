"""What a mixer needs to run on part of a sequence at a time (incremental decoding) and on padded batches: the
state it keeps between calls, and the padding helpers the mixers share. Training passes neither; the HF classes
(flame/hf/modeling.py) do.

Padding is a 2D mask [B, Tpast + T] over every token seen so far (HF's ``attention_mask``, 1 = real token).
Attention layers hide padded keys; recurrent layers let padded tokens change nothing: their convolution inputs are
zero (as before the start of a sequence) and their delta-rule step keeps the state (beta = 0, decay g = 0). So with
left padding the real tokens see exactly what they would see unpadded; with right padding the padded tokens come
after every real one, which a causal model never reads.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class MixerCache:
    """One layer's state after the tokens seen so far: attention keys (after RoPE) and values [B, T, HKV, D] of
    every position; for recurrent mixers the last W-1 inputs of each short convolution (by name) and the
    recurrence's state."""

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    conv: dict[str, torch.Tensor] = field(default_factory=dict)
    recurrent: torch.Tensor | None = None

    def map_batch(self, fn) -> None:
        """Apply fn to every cached tensor (along the batch dimension: beam reordering, batch selection)."""
        self.key = None if self.key is None else fn(self.key)
        self.value = None if self.value is None else fn(self.value)
        self.conv = {name: fn(t) for name, t in self.conv.items()}
        self.recurrent = None if self.recurrent is None else fn(self.recurrent)


def current_token_mask(attention_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """[B, T] bool of the current tokens (the last T columns of the mask), or None without a mask."""
    return None if attention_mask is None else attention_mask[:, -seq_len:].bool()


def zero_padded(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, ...] with the padded tokens' entries set to 0 (where, not a product: a NaN there stays out)."""
    if mask is None:
        return x
    return torch.where(mask.view(*mask.shape, *([1] * (x.ndim - 2))), x, torch.zeros((), dtype=x.dtype))


def convolve(conv, x: torch.Tensor, cache: MixerCache | None, name: str) -> torch.Tensor:
    """conv(x), continuing from the cached last inputs of this convolution (zeros at the first call, which is the
    convolution's own zero padding) and updating them."""
    if cache is None:
        return conv(x)
    keep = conv.kernel_size[0] - 1
    past = cache.conv.get(name)
    if past is None:
        past = x.new_zeros(x.shape[0], keep, x.shape[2])
    window = torch.cat([past, x], dim=1)
    cache.conv[name] = window[:, window.shape[1] - keep :]
    return conv(x, past_inputs=past)
