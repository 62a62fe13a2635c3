"""Pieces every model family shares: the config-JSON args base and the decoder skeleton."""
