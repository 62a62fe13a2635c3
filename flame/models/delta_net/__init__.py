"""DeltaNet (FLA model_type ``delta_net``) and its attention hybrids."""

from flame.models.common.spec import ModelSpec, built_by
from flame.models.delta_net.args import DeltaNetArgs

SPEC = ModelSpec(args_cls=DeltaNetArgs, model_cls=built_by("flame.models.delta_net.model", "DeltaNetModel"))
