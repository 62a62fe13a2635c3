"""Every configs/*.json (and the default job's flame/assets/tiny.json) passes the config-key check that the dry run
applies (each key read by the family or passed over for a reason in IRRELEVANT_KEYS / RESTRICTED_KEYS; nothing is
refused), builds on the meta device (all of them, in one process), and docs/configs.md shows their parameter
counts."""

import importlib.util
from pathlib import Path

import pytest

from flame.models import load_model_args

REPO = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("config_table", REPO / "scripts" / "config_table.py")
config_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_table)
CONFIG_DIR, RECIPES, config_rows, render_table = (
    config_table.CONFIG_DIR,
    config_table.RECIPES,
    config_table.config_rows,
    config_table.render_table,
)

CONFIGS = sorted(CONFIG_DIR.glob("*.json"))
DOC = Path(__file__).parents[2] / "docs" / "configs.md"
DEFAULT = REPO / "flame" / "assets" / "tiny.json"


@pytest.mark.parametrize("path", [*CONFIGS, DEFAULT], ids=[p.stem for p in [*CONFIGS, DEFAULT]])
def test_config_passes_the_key_check(path):
    args, unknown = load_model_args(path)  # ModelConfigError (one line) for a refused key
    assert not args.generic and unknown == []
    assert path == DEFAULT or path.stem in RECIPES, "describe the new config in scripts/config_table.py"


def test_all_configs_build_on_meta_and_docs_table_is_current():
    rows = config_rows()
    assert len(rows) == len(CONFIGS) and all(count > 0 for *_, count in rows)
    assert render_table(rows) in DOC.read_text(), "regenerate with: python scripts/config_table.py"
