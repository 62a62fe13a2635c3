"""Llama-style transformer (FLA model_type ``transformer``), with the softpick family of attention."""

from flame.models.common.spec import ModelSpec
from flame.models.transformer.args import TransformerArgs
from flame.models.transformer.model import Transformer

SPEC = ModelSpec(args_cls=TransformerArgs, model_cls=Transformer)
