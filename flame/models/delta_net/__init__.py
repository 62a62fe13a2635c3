"""DeltaNet (FLA model_type ``delta_net``) and its attention hybrids."""

from flame.models.common.spec import ModelSpec
from flame.models.delta_net.args import DeltaNetArgs
from flame.models.delta_net.model import DeltaNetModel

SPEC = ModelSpec(args_cls=DeltaNetArgs, model_cls=DeltaNetModel)
