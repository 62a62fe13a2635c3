"""flame: train linear-attention, softpick and hybrid language models on torchtitan."""

__version__ = "0.1.0"
