"""Gated DeltaNet (FLA model_type ``gated_deltanet``) and its attention hybrids."""

from flame.models.common.spec import ModelSpec, built_by
from flame.models.gated_deltanet.args import GatedDeltaNetArgs

SPEC = ModelSpec(
    args_cls=GatedDeltaNetArgs, model_cls=built_by("flame.models.gated_deltanet.model", "GatedDeltaNetModel")
)
