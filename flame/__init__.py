"""flame: train linear-attention, softpick and hybrid language models on torchtitan."""

__version__ = "0.1.0"

# flame's HF model types (flame_transformer, ...) join transformers' Auto classes when transformers loads them;
# nothing is imported here (see flame.hf).
from flame.compat import defer_torchtitan_import_compile as _defer_torchtitan_import_compile
from flame.compat import defer_transformers_sklearn_import as _defer_transformers_sklearn_import
from flame.hf import install as _install_hf_types

_install_hf_types()
# Before anything imports torchtitan: its import-time torch.compile waits for a first call (flame/compat.py).
_defer_torchtitan_import_compile()
# Before anything imports transformers' generation: scikit-learn is imported at its first use (flame/compat.py).
_defer_transformers_sklearn_import()
