"""Sequence-mixing ops: a PyTorch implementation of each (the CPU path and the reference for GPU kernels) and CUDA
backends (FLA 0.6.0's Triton ops, flame's own kernels), chosen per call by one table (dispatch.py).

Importing this package does not import FLA or Triton; the CUDA branches import FLA on first use.
"""

from flame.ops.attention import attention, scale_queries_by_position
from flame.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
from flame.ops.gated_delta_rule import chunk_gated_delta_rule
from flame.ops.norm import gated_rms_norm, l2norm, rms_norm
from flame.ops.short_conv import short_conv
from flame.ops.varlen import position_ids_from_cu_seqlens

__all__ = [
    "attention",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "fused_recurrent_delta_rule",
    "gated_rms_norm",
    "l2norm",
    "position_ids_from_cu_seqlens",
    "rms_norm",
    "scale_queries_by_position",
    "short_conv",
]
