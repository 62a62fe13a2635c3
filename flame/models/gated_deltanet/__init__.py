"""Gated DeltaNet (FLA model_type ``gated_deltanet``) and its attention hybrids."""

from flame.models.common.spec import ModelSpec
from flame.models.gated_deltanet.args import GatedDeltaNetArgs
from flame.models.gated_deltanet.model import GatedDeltaNetModel

SPEC = ModelSpec(args_cls=GatedDeltaNetArgs, model_cls=GatedDeltaNetModel)
