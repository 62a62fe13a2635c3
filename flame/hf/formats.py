"""Which HF format a model is exported in, and how an HF checkpoint is read back (no transformers import).

Export formats (``--format``):
- ``auto`` (default): the first that computes exactly what flame trained, of ``llama``/``olmo_hybrid``
  (transformers loads them with no extra import, on any machine), ``fla``, then ``flame``;
- ``fla``: FLA's model_type (``transformer``, ``gated_deltanet``, ``delta_net``); loads after ``import fla``;
- ``flame``: flame's model_type (``flame_<family>``); loads after ``import flame``, runs flame's model code;
- ``llama`` (transformer) and ``olmo_hybrid`` (gated_deltanet): transformers' own classes, no import needed;
- ``hf`` (the generic family's only format, its ``auto``): the model's own model_type and parameter names; loads
  with plain transformers (after ``import fla`` for FLA's types, after importing the package of a user's class).
An explicit format that cannot express the model exactly is refused with the reason.
"""

import importlib

from flame.hf.export_options import EXPORT_FORMATS
from flame.models import FAMILIES, family_module, get_model_spec, model_args_from_dict
from flame.models.common.args import ModelArgs
from flame.models.common.state_dict_adapter import ExportError, StateDictAdapter

# What ``auto`` tries, in order, before flame's own format (which expresses every flame model). transformers' own
# classes come first: FLA's transformer needs flash-attn on a GPU, so a CPU-trained model exported in FLA's
# format would not load on the machine that trained it.
AUTO_ORDER = ("llama", "olmo_hybrid", "fla")


def family_adapters(args: ModelArgs) -> dict[str, type[StateDictAdapter]]:
    return importlib.import_module(f"{family_module(args)}.state_dict_adapter").ADAPTERS


def export_adapter(args: ModelArgs, fmt: str = "auto") -> tuple[StateDictAdapter, str | None]:
    """The adapter for an export, and for ``auto`` a note on why FLA's format was not taken (else None)."""
    adapters = family_adapters(args)
    if fmt == "auto" and "fla" not in adapters:  # the generic family: its own format
        return adapters["hf"](args), None
    if fmt == "auto":
        for name in (f for f in AUTO_ORDER if f in adapters):
            adapter = adapters[name](args, check=False)
            if not (problems := adapter.incompatibilities()):
                return adapter, None
        note = f"FLA's {args.model_type} would compute a different model ({'; '.join(problems)})"
        return adapters["flame"](args), note
    if fmt not in adapters:
        known = ", ".join(f for f in EXPORT_FORMATS if f == "auto" or f in adapters)
        raise ExportError(
            f"format {fmt} is not available for {args.model_type} models; choose one of: {known}"
        )
    return adapters[fmt](args), None


def import_adapter(config: dict) -> StateDictAdapter:
    """flame's args and the adapter for an HF checkpoint's config.json."""
    model_type = config.get("model_type")
    # FLA's format: flame reads FLA's config fields (and its own extensions) as written.
    if model_type in FAMILIES:
        args, _ = get_model_spec(model_type).args_cls.from_dict(config)
        return family_adapters(args)["fla"](args, check=False)
    family = model_type.removeprefix("flame_") if isinstance(model_type, str) else None
    if family != model_type and family in FAMILIES:
        values = {k: v for k, v in config.items() if k != "model_type"}
        args, _ = get_model_spec(family).args_cls.from_dict(values)
        return family_adapters(args)["flame"](args, check=False)
    if model_type == "llama":
        from flame.models.transformer.state_dict_adapter import LlamaAdapter

        return LlamaAdapter(LlamaAdapter.args_from_hf_config(config))
    if model_type == "olmo_hybrid":
        from flame.models.gated_deltanet.state_dict_adapter import OlmoHybridAdapter

        return OlmoHybridAdapter(OlmoHybridAdapter.args_from_hf_config(config))
    if not isinstance(model_type, str):
        raise ExportError(f"the HF config has no model_type (got {model_type!r})")
    # Any other model_type that transformers knows: the generic family, under the class's own names.
    args, _ = model_args_from_dict(config)
    return family_adapters(args)["hf"](args, check=False)
