"""Config JSON with non-finite floats (flame/models/common/config_json.py): read as transformers writes them and as
Python's json writes them, written so that any JSON reader parses them."""

import json
import math

import pytest

from flame.models.common.config_json import dumps_config, loads_config


def test_tagged_and_literal_infinities_read_as_floats():
    text = '{"a": [0.0, {"__float__": "Infinity"}], "b": {"__float__": "-Infinity"}, "c": Infinity, "d": {"__float__": "NaN"}}'  # fmt: skip
    config = loads_config(text)
    assert config["a"] == [0.0, math.inf] and config["b"] == -math.inf and config["c"] == math.inf
    assert math.isnan(config["d"])


@pytest.mark.parametrize("obj", [{"__float__": "big"}, {"__float__": "Infinity", "x": 1}, {"__float__": 3}])
def test_other_objects_stay_objects(obj):
    assert loads_config(json.dumps({"k": obj})) == {"k": obj}


def test_written_configs_are_strict_json_and_read_back():
    config = {"dt_limit": (0.0, math.inf), "nested": {"low": -math.inf, "x": [1, 2.5]}, "nan": math.nan, "s": "Infinity"}  # fmt: skip
    text = dumps_config(config, indent=2)
    json.loads(text, parse_constant=lambda name: pytest.fail(f"a bare {name} in {text}"))
    again = loads_config(text)
    assert again["dt_limit"] == [0.0, math.inf] and again["nested"] == {"low": -math.inf, "x": [1, 2.5]}
    assert math.isnan(again["nan"]) and again["s"] == "Infinity"


def test_transformers_reads_what_flame_writes_and_flame_what_transformers_writes(tmp_path):
    from transformers import Mamba2Config

    (tmp_path / "config.json").write_text(
        dumps_config({"model_type": "mamba2", "time_step_limit": [0.0, math.inf]})
    )
    assert Mamba2Config.from_pretrained(tmp_path).time_step_limit[1] == math.inf
    Mamba2Config(time_step_limit=(0.0, math.inf)).save_pretrained(tmp_path / "saved")
    assert loads_config((tmp_path / "saved" / "config.json").read_text())["time_step_limit"] == [
        0.0,
        math.inf,
    ]
