"""Model families, looked up by the ``model_type`` of an HF-style config JSON."""

import importlib
import json
from pathlib import Path

from flame.errors import ModelConfigError
from flame.models.common.args import ModelArgs
from flame.models.common.spec import ModelSpec

# model_type -> module exposing the family's args class and model class
FAMILIES: dict[str, str] = {
    "transformer": "flame.models.transformer",
    "gated_deltanet": "flame.models.gated_deltanet",
    "delta_net": "flame.models.delta_net",
}


def get_model_spec(model_type: str) -> ModelSpec:
    if model_type not in FAMILIES:
        raise ModelConfigError(
            f"model_type '{model_type}' is not supported; flame knows: {', '.join(sorted(FAMILIES))}"
        )
    return importlib.import_module(FAMILIES[model_type]).SPEC


def read_model_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ModelConfigError(
            f"model config {path} does not exist; pass --model.config <file.json> (see configs/)"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(
            f"model config {path} is not valid JSON ({e.msg} at line {e.lineno}); fix the file"
        ) from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelConfigError(
            f"model config {path} has no 'model_type'; add one of: {', '.join(sorted(FAMILIES))}"
        )
    return config


def load_model_args(path: str | Path) -> tuple[ModelArgs, list[str]]:
    """Args of the model described by a config JSON, and the keys flame did not understand."""
    config = read_model_config(path)
    spec = get_model_spec(config["model_type"])
    try:
        return spec.args_cls.from_dict(config)
    except ModelConfigError as e:
        raise ModelConfigError(f"{path}: {e}") from e
    except TypeError as e:  # a field given with a type the dataclass cannot take
        raise ModelConfigError(f"{path}: {e}") from e


def build_model(args: ModelArgs):
    return get_model_spec(args.model_type).model_cls(args)
