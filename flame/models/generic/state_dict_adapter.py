"""The generic family's one HF format: the class's own (its model_type, its parameter names, which flame trains
under unchanged), loadable with plain transformers once the class is registered."""

from typing import Any

import torch

from flame.models.common.state_dict_adapter import State, StateDictAdapter


class GenericAdapter(StateDictAdapter):
    format = "hf"

    def tied_keys(self) -> dict[str, str]:
        """{tied parameter: the parameter it shares}, as the class declares them (transformers saves the shared
        one only)."""
        from flame.models import build_model

        with torch.device("meta"):
            return dict(build_model(self.args).all_tied_weights_keys)

    def hf_config(self) -> dict[str, Any]:
        from flame.models.generic.model import causal_lm_class

        return {**self.args.hf_dict(), "architectures": [causal_lm_class(self.args.hf_config()).__name__]}

    def to_hf(self, state_dict: State) -> State:
        tied = self.tied_keys()
        return {k: v for k, v in state_dict.items() if k not in tied}

    def from_hf(self, hf_state_dict: State) -> State:
        tied = {k: hf_state_dict[v] for k, v in self.tied_keys().items() if k not in hf_state_dict}
        return {**hf_state_dict, **tied}


ADAPTERS = {"hf": GenericAdapter}
