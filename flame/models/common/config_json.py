"""Model config JSON as transformers writes it: infinities and NaN as ``{"__float__": "Infinity"}`` objects.

transformers 5 (``PreTrainedConfig.to_json_string``) tags non-finite floats so that other JSON readers can parse
the file; a config saved by it (Mamba2's ``time_step_limit`` is ``[0.0, inf]`` by default) would otherwise reach a
model as a dict where a float belongs. Python's own ``Infinity`` literals are read too.
"""

import json
import math
from typing import Any

FLOAT_TAG = "__float__"
TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def untag_float(obj: dict) -> Any:
    """A JSON object: the float it tags, or the object itself (json.loads' object_hook)."""
    if obj.keys() == {FLOAT_TAG} and obj[FLOAT_TAG] in TAGGED_FLOATS:
        return TAGGED_FLOATS[obj[FLOAT_TAG]]
    return obj


def tag_floats(value: Any) -> Any:
    """``value`` with each non-finite float as the tagged object transformers writes."""
    if isinstance(value, float) and not math.isfinite(value):
        return {FLOAT_TAG: "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, dict):
        return {k: tag_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [tag_floats(v) for v in value]
    return value


def loads_config(text: str) -> Any:
    """A config JSON's content, tagged floats read as floats."""
    return json.loads(text, object_hook=untag_float)


def dumps_config(config: dict, **kwargs) -> str:
    """A config as JSON that any reader parses, non-finite floats tagged the way transformers writes them."""
    return json.dumps(tag_floats(config), allow_nan=False, **kwargs)
