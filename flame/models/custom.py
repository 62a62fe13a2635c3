"""Importing the user's own model code before a model is built (train.sh's pre-flight, the trainer, the HF
converter): ``--experimental.custom_model_path`` (a package folder, a .py file or a dotted module name),
``--experimental.custom_import`` (a dotted module name) and, as upstream flame does, a package named
``custom_models`` on the path. A module registers its classes with transformers' AutoConfig and
AutoModelForCausalLM when imported; the generic family (flame.models.generic) then builds them.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

from flame.errors import ConfigError

CONVENTION = "custom_models"
# module name -> the target it was imported from (a resolved path or a dotted name), in import order
IMPORTED: dict[str, str] = {}


def import_target(target: str) -> str:
    """Import one module given by path or dotted name; returns its module name. One line on failure."""
    path = Path(target)
    if path.exists():
        path = path.resolve()
        if path.is_dir() and not (path / "__init__.py").is_file():
            raise ConfigError(
                f"custom model path {target} is a folder without __init__.py; pass a package or a .py file"
            )
        name = path.stem
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        target = str(path)
    else:
        name = target
    if name in IMPORTED:
        return name
    try:
        importlib.import_module(name)
    except Exception as e:  # whatever the user's module raises, in one line
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(
            f"cannot import the custom model module {target}: {type(e).__name__}: {message}"
        ) from e
    IMPORTED[name] = target
    return name


def import_targets(targets: list[str]) -> None:
    for target in targets:
        import_target(target)


def import_custom_modules(experimental) -> None:
    """Import the job's custom model modules (``experimental`` is the job config's section)."""
    targets = [experimental.custom_model_path, experimental.custom_import]
    if importlib.util.find_spec(CONVENTION) is not None:
        targets.append(CONVENTION)
    import_targets([t for t in targets if t])


def imports_defining(cls: type) -> list[str]:
    """The imported targets whose module (or package) defines ``cls``."""
    return [
        target
        for name, target in IMPORTED.items()
        if cls.__module__ == name or cls.__module__.startswith(f"{name}.")
    ]
