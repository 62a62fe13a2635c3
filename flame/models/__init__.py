"""Model families, looked up by the ``model_type`` of an HF-style config JSON (or of an HF model folder's
config.json).

flame's own families are in FAMILIES; any other model_type that transformers' Auto classes know (transformers'
own models, FLA's after ``import fla``, a user's registered class) goes through the generic path,
flame.models.generic. Each family module exposes its ModelSpec as ``SPEC`` (flame/models/common/spec.py).
"""

import importlib
import json
from pathlib import Path

from flame.errors import ModelConfigError
from flame.models.common.args import ModelArgs
from flame.models.common.config_json import loads_config
from flame.models.common.spec import ModelSpec

# model_type -> module exposing the family's SPEC
FAMILIES: dict[str, str] = {
    "transformer": "flame.models.transformer",
    "gated_deltanet": "flame.models.gated_deltanet",
    "delta_net": "flame.models.delta_net",
}
# Every model_type flame does not implement itself.
GENERIC_FAMILY = "flame.models.generic"
# Which implementation builds a model (--model.impl): auto (flame's family for its model_type, else FLA's class,
# else transformers'), flame, fla (FLA's class, through the generic path) or hf (transformers' own class, or a
# user's registered one, through the generic path). flame records a choice other than auto in the configs it writes
# (checkpoints' flame.json, model_config.json) under IMPL_KEY, so that they rebuild the same class.
IMPL_KEY = "flame_impl"
IMPLS = ("auto", "flame", "fla", "hf")


def get_model_spec(model_type: str) -> ModelSpec:
    """The entry of one of flame's own families."""
    if model_type not in FAMILIES:
        raise ModelConfigError(
            f"model_type '{model_type}' is not supported; flame knows: {', '.join(sorted(FAMILIES))}"
        )
    return importlib.import_module(FAMILIES[model_type]).SPEC


def family_module(args: ModelArgs) -> str:
    """The module of the family that built ``args``."""
    return GENERIC_FAMILY if args.generic else FAMILIES[args.model_type]


def model_spec(args: ModelArgs) -> ModelSpec:
    return importlib.import_module(family_module(args)).SPEC


def read_model_config(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():  # an HF model folder
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(
            f"model config {path} does not exist; pass --model.config <file.json or HF model folder> (see configs/)"
        )
    try:
        config = loads_config(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(
            f"model config {path} is not valid JSON ({e.msg} at line {e.lineno}); fix the file"
        ) from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelConfigError(
            f"model config {path} has no 'model_type'; add one of: {', '.join(sorted(FAMILIES))}, "
            "or a model_type transformers knows"
        )
    return config


def chosen_impl(config: dict, impl: str) -> str:
    """The implementation of ``impl`` (--model.impl) and the config's recorded choice together."""
    recorded = config.get(IMPL_KEY, "auto")
    for value, where in ((impl, "--model.impl"), (recorded, IMPL_KEY)):
        if value not in IMPLS:
            raise ModelConfigError(f"{where} must be one of {', '.join(IMPLS)}, got {value!r}")
    if "auto" not in (impl, recorded) and impl != recorded:
        raise ModelConfigError(
            f"--model.impl {impl} contradicts the config's {IMPL_KEY} {recorded} (the implementation its "
            f"checkpoints were trained with); drop --model.impl or remove {IMPL_KEY} from the config"
        )
    return recorded if impl == "auto" else impl


def model_args_from_dict(config: dict, impl: str = "auto") -> tuple[ModelArgs, list[str]]:
    """Args of the model a config dict describes, built by ``impl`` (--model.impl; the config's ``flame_impl``
    when auto), and a notice per key read under its newer name (the generic path's older FLA names). A key the
    model would ignore is refused (ModelConfigError) on every path."""
    impl = chosen_impl(config, impl)
    model_type = config["model_type"]
    if impl == "flame" and model_type not in FAMILIES:
        raise ModelConfigError(
            f"--model.impl flame: flame has no implementation of model_type '{model_type}' (it implements "
            f"{', '.join(sorted(FAMILIES))}); use --model.impl auto"
        )
    values = {k: v for k, v in config.items() if k != IMPL_KEY}
    if impl == "flame" or (impl == "auto" and model_type in FAMILIES):
        return get_model_spec(model_type).args_cls.from_dict(values)
    return importlib.import_module(GENERIC_FAMILY).SPEC.args_cls.from_dict(values, impl=impl)


def load_model_args(path: str | Path, impl: str = "auto") -> tuple[ModelArgs, list[str]]:
    """Args of the model described by a config JSON or HF model folder, built by ``impl`` (--model.impl), and a
    notice per key read under its newer name."""
    config = read_model_config(path)
    try:
        return model_args_from_dict(config, impl)
    except ModelConfigError as e:
        raise ModelConfigError(f"{path}: {e}") from e
    except TypeError as e:  # a field given with a type the dataclass cannot take
        raise ModelConfigError(f"{path}: {e}") from e


def build_model(args: ModelArgs):
    return model_spec(args).model_cls(args)


def check_device(args: ModelArgs, device_type: str) -> None:
    """Refuse, in one line, to train a model that cannot run here: one that needs a CUDA GPU, on another device."""
    if device_type != "cuda" and (reason := model_spec(args).cuda_reason(args)):
        raise ModelConfigError(
            f"{reason}: it needs a CUDA GPU and this run has none; on a CPU flame trains its own families "
            "(transformer, gated_deltanet, delta_net and their variants; --model.impl flame) and transformers' "
            "classes (llama, qwen3, olmo2, ...)"
        )
