"""Pieces model families share: the config-JSON args base, the values configs choose from (``choices``), the decoder
skeleton, hybrid attention specs (``attn``) and the weight-decay rule."""
