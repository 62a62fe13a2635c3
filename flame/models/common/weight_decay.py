"""Which parameters weight decay should skip.

The rule (OLMo-core's and Mamba's; FLA marks A_log and dt_bias with ``_no_weight_decay`` for the same reason):
decay only matrices. Every parameter with fewer than two dimensions is excluded: norm scales, biases, the decay
parameters A_log and dt_bias, the per-head query scales of scaled attention. Matrices are decayed, including the
[D, 1, W] short-convolution kernels. Embeddings are decayed unless ``exclude_embeddings`` is set: flame's and FLA's
recipes decay them, OLMo's exclude them (``embeddings.weight``; a tied lm_head is the same parameter).

The rule looks at names and shapes only, never at attributes set on parameters, which FSDP's re-wrapping drops;
shapes of DTensors are global, so the result is the same before and after sharding.
"""

from torch import nn

EMBEDDING_NAME = "embeddings.weight"


def no_weight_decay_names(model: nn.Module, exclude_embeddings: bool = False) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the parameters to put in a weight_decay=0 group."""
    names = {name for name, param in model.named_parameters() if param.ndim < 2}
    if exclude_embeddings:
        names |= {
            name
            for name, _ in model.named_parameters()
            if name == EMBEDDING_NAME or name.endswith("." + EMBEDDING_NAME)
        }
    return names
