"""What a model family registers: its args class and model class (parallelization hooks join later)."""

from dataclasses import dataclass

from flame.models.common.args import ModelArgs


@dataclass(frozen=True)
class ModelSpec:
    args_cls: type[ModelArgs]
    model_cls: type
