"""Config classes of flame's HF model types: a flame model config (the family's args, as ``to_dict`` writes
them) under model_type ``flame_<family>``."""

from transformers.configuration_utils import PreTrainedConfig


class FlameConfig(PreTrainedConfig):
    family = ""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        # The model classes are registered with AutoModelForCausalLM when the first flame config is built.
        from flame.hf import register_models

        register_models()

    def flame_args(self):
        """The family's ModelArgs (validated) for this config."""
        from flame.models import get_model_spec

        values = {k: v for k, v in self.to_dict().items() if k != "model_type"}
        args, _ = get_model_spec(self.family).args_cls.from_dict(values)
        return args


class FlameTransformerConfig(FlameConfig):
    model_type = "flame_transformer"
    family = "transformer"


class FlameGatedDeltaNetConfig(FlameConfig):
    model_type = "flame_gated_deltanet"
    family = "gated_deltanet"


class FlameDeltaNetConfig(FlameConfig):
    model_type = "flame_delta_net"
    family = "delta_net"


CONFIG_CLASSES = (FlameTransformerConfig, FlameGatedDeltaNetConfig, FlameDeltaNetConfig)
