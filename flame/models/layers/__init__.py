"""Building blocks shared by every model family: one class per mixer, with a uniform forward
``(hidden_states [B, T, D], position_ids, cu_seqlens=None) -> hidden_states [B, T, D]``."""
