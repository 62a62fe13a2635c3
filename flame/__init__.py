"""flame: train linear-attention, softpick and hybrid language models on torchtitan."""

__version__ = "0.1.0"

# flame's HF model types (flame_transformer, ...) join transformers' Auto classes when transformers loads them;
# nothing is imported here (see flame.hf).
from flame.hf import install as _install_hf_types

_install_hf_types()
