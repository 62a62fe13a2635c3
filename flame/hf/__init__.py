"""flame's own HF model types, for models FLA's classes would compute differently (softpick attention, layer-wise
scaling, window patterns, hybrid q/k norm ...): ``flame_transformer``, ``flame_gated_deltanet``,
``flame_delta_net``. Their config.json files load with ``AutoModelForCausalLM.from_pretrained(dir)`` after
``import flame``; without it transformers rejects the unknown model_type, so such a model never loads silently as
one of FLA's (a softpick model as softmax).

``import flame`` calls :func:`install`, which costs nothing up front: transformers' Auto classes are extended when
``transformers.models.auto.configuration_auto`` is (or already was) imported, and the model classes, which import
torch and flame's model code, when a flame config is first built (that is, before a flame model is looked up).
"""

import importlib.abc
import importlib.machinery
import logging
import sys

logger = logging.getLogger(__name__)

CONFIG_AUTO = "transformers.models.auto.configuration_auto"
MODEL_AUTO = "transformers.models.auto.modeling_auto"

_state = {"configs": False, "models": False}


def register_configs() -> None:
    if _state["configs"]:
        return
    from transformers.models.auto.configuration_auto import AutoConfig

    from flame.hf.configuration import CONFIG_CLASSES

    for config_class in CONFIG_CLASSES:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    _state["configs"] = True
    if "transformers.modeling_utils" in sys.modules:  # model code already loaded: registering is cheap now
        register_models()


def register_models() -> None:
    if _state["models"]:
        return
    modeling = sys.modules.get("flame.hf.modeling")
    if modeling is not None and not hasattr(modeling, "MODEL_CLASSES"):
        return  # flame.hf.modeling is being imported (its transformers imports got here): it registers at its end
    _state["models"] = True
    from transformers.models.auto.modeling_auto import AutoModelForCausalLM

    from flame.hf.configuration import CONFIG_CLASSES
    from flame.hf.modeling import MODEL_CLASSES

    for config_class, model_class in zip(CONFIG_CLASSES, MODEL_CLASSES):
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)


def register() -> None:
    """Register everything now (imports transformers and torch)."""
    register_configs()
    register_models()


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs register_configs() right after transformers' configuration_auto module has been executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != CONFIG_AUTO:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            register_configs()
        except Exception as e:  # never break transformers' import
            logger.warning(f"flame could not register its HF model types with transformers: {e}")


def install() -> None:
    if CONFIG_AUTO in sys.modules:
        register_configs()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
