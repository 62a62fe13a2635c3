"""Pieces model families share: the config-JSON args base, the decoder skeleton, hybrid attention specs (``attn``)
and the weight-decay rule."""
