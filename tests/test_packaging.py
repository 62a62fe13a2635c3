"""pyproject.toml declares what flame imports: every third-party module imported under flame/ comes from a
distribution named in the dependencies or an extra (one not installed here, such as the GPU-only flash-qla, by the
module's own name); tomli only where tomllib is missing."""

import ast
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.utils.helpers import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def requirements() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    return {group: [Requirement(spec) for spec in specs] for group, specs in groups.items()}


def imported_modules(root: Path) -> dict[str, Path]:
    """Top-level names of the absolute imports under root, with one file importing each."""
    modules = {}
    for file in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                modules.setdefault(name.split(".")[0], file)
    return modules


def test_every_imported_third_party_module_is_declared():
    declared = {canonicalize_name(r.name) for reqs in requirements().values() for r in reqs}
    providers = packages_distributions()
    missing = []
    for module, file in imported_modules(REPO / "flame").items():
        if module in sys.stdlib_module_names or module in ("flame", "tomli"):
            continue
        # A module this machine lacks is declared when a requirement carries its name (a GPU-only extra).
        distributions = {canonicalize_name(d) for d in providers.get(module, [module])}
        if not distributions & declared:
            missing.append(
                f"{module} ({file.relative_to(REPO)}; from {sorted(distributions) or 'nothing installed'})"
            )
    assert missing == []


def test_tomli_only_before_python_3_11_and_triton_not_pinned_beside_torch():
    dependencies = {canonicalize_name(r.name): r for r in requirements()["dependencies"]}
    tomli = dependencies["tomli"]
    assert tomli.marker is not None
    assert tomli.marker.evaluate({"python_version": "3.10"}) and not tomli.marker.evaluate(
        {"python_version": "3.11"}
    )
    assert "triton" not in dependencies  # torch's CUDA wheels pin their own
    assert {"dev", "eval", "wandb", "zstd"} <= set(requirements())
