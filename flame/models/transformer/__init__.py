"""Llama-style transformer (FLA model_type ``transformer``), with the softpick family of attention."""

from flame.models.common.spec import ModelSpec, built_by
from flame.models.transformer.args import TransformerArgs

SPEC = ModelSpec(
    args_cls=TransformerArgs, model_cls=built_by("flame.models.transformer.model", "Transformer")
)
