"""Args of a generic-family model: the config JSON as written, read through the config class transformers has
registered for its model_type."""

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from flame.errors import ModelConfigError
from flame.models import IMPL_KEY, custom
from flame.models.common.args import IGNORED_KEYS, ModelArgs

# Written by flame into a generic model's config (flame.json, model_config.json), never into an HF export: the
# user modules that register its classes, imported again wherever the config is read (the HF converter after a run).
CUSTOM_IMPORTS_KEY = "flame_custom_imports"
# What transformers writes into every config.json; not architecture.
HF_BOOKKEEPING = {
    "_name_or_path",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "use_cache",
}


def config_class(model_type: str) -> type:
    """The config class transformers has registered for ``model_type``; FLA's are registered on ``import fla``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        # FLA warns on import on machines without a GPU; the model is only built here, not run.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fla.models  # noqa: F401  (registers FLA's model types with transformers)
    if model_type not in CONFIG_MAPPING:
        raise ModelConfigError(
            f"model_type '{model_type}' is not supported: flame has no family of that name and transformers has "
            "no class registered for it (import the package that registers it with "
            "--experimental.custom_model_path or --experimental.custom_import)"
        )
    return CONFIG_MAPPING[model_type]


def accepted_keys(cls: type) -> set[str]:
    """Every key a config class's constructor takes, its own and its bases' (transformers passes **kwargs up)."""
    keys = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            keys |= set(inspect.signature(klass.__init__).parameters) - {"self", "kwargs"}
    return keys


@dataclass
class GenericArgs(ModelArgs):
    generic: ClassVar[bool] = True

    model_type: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the config JSON, model_type and vocab_size aside
    custom_imports: list[str] = field(default_factory=list)
    impl: str = "auto"  # the config's flame_impl: auto, fla or hf

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> tuple["GenericArgs", list[str]]:
        imports = list(config.get(CUSTOM_IMPORTS_KEY, []))
        custom.import_targets(imports)
        model_type = config["model_type"]
        config_cls = config_class(model_type)
        impl = config.get(IMPL_KEY, "auto")
        if impl == "fla" and not config_cls.__module__.startswith("fla."):
            raise ModelConfigError(
                f"{IMPL_KEY} fla: the class transformers holds for model_type '{model_type}' is not FLA's "
                f"({config_cls.__module__}.{config_cls.__name__}); use auto or hf"
            )
        values = {k: v for k, v in config.items() if k not in ("model_type", CUSTOM_IMPORTS_KEY, IMPL_KEY)}
        try:
            hf_config = config_cls(**values)
        except (TypeError, ValueError) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelConfigError(f"{config_cls.__name__} refuses this config: {first_line}") from e
        known = accepted_keys(config_cls) | IGNORED_KEYS | HF_BOOKKEEPING
        unknown = sorted(k for k in values if k not in known)
        args = cls(
            vocab_size=getattr(hf_config, "vocab_size", None),
            hidden_size=getattr(hf_config, "hidden_size", 0),
            num_hidden_layers=getattr(hf_config, "num_hidden_layers", 0),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_id=getattr(hf_config, "eos_token_id", None),
            model_type=model_type,
            config={k: v for k, v in values.items() if k != "vocab_size"},
            custom_imports=imports or custom.imports_defining(config_cls),
            impl=impl,
        )
        args.validate()
        return args, unknown

    def validate(self) -> None:
        if not isinstance(self.vocab_size, int) or self.vocab_size <= 0:
            raise ModelConfigError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")

    def hf_dict(self) -> dict[str, Any]:
        """The model's config as transformers reads it (the config JSON with this run's vocab_size)."""
        return {**self.config, "model_type": self.model_type, "vocab_size": self.vocab_size}

    def hf_config(self):
        values = self.hf_dict()
        del values["model_type"]
        return config_class(self.model_type)(**values)

    def to_dict(self) -> dict[str, Any]:
        record = {CUSTOM_IMPORTS_KEY: self.custom_imports} if self.custom_imports else {}
        if self.impl != "auto":
            record[IMPL_KEY] = self.impl
        return {**self.hf_dict(), **record}

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """6 x non-embedding parameters per token; the sequence mixers' own terms (softmax attention, recurrent
        states) are not counted for generic families, so MFU reads low for long sequences."""
        nparams = sum(p.numel() for p in model.parameters())
        embeddings = model.get_input_embeddings().weight.numel()
        dense = nparams if self.tie_word_embeddings else nparams - embeddings
        return nparams, 6 * dense
