"""DeltaNet's HF formats: FLA's ``delta_net`` and flame's ``flame_delta_net`` (FLA's names in both)."""

from flame.models.common.state_dict_adapter import FlaAdapter, FlameAdapter, hybrid_fla_incompatibilities


class DeltaNetFlaAdapter(FlaAdapter):
    architecture = "DeltaNetForCausalLM"

    def incompatibilities(self) -> list[str]:
        return hybrid_fla_incompatibilities(self.args)


class DeltaNetFlameAdapter(FlameAdapter):
    architecture = "FlameDeltaNetForCausalLM"


ADAPTERS = {"fla": DeltaNetFlaAdapter, "flame": DeltaNetFlameAdapter}
