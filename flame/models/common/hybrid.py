"""Hybrids: FLA's ``attn`` config field, which puts standard attention at chosen layers of a linear-attention model.

The JSON spelling is FLA 0.6.0's, extended by flame:

    "attn": {"layers": [3, 7, 11], "num_heads": 16, "num_kv_heads": 4, "qkv_bias": false,
             "window_size": null, "rope_theta": 10000.0}

or a list of such dicts with disjoint layers (e.g. sliding-window attention at some layers, full at others). As in
FLA, "layers" and "num_heads" are required, the attention head_dim is hidden_size // num_heads, RoPE is always on,
and the other layers keep the family's own mixer. flame adds, inside a spec:

- ``"every": N`` with ``"offset": k`` (default 0) in place of "layers": attention at every layer i with
  i % N == k; the OLMo 3 hybrid is ``{"every": 4, "offset": 3, ...}``. FLA's config class requires "layers", so a
  config spelled this way loads in flame only. flame normalises every spec to an explicit "layers" list with all
  defaults filled in (that is what ``args.to_dict()`` writes), so configs exported by flame load in FLA.
- ``"qk_norm": true``: RMSNorm of q and k, per head (``"qk_norm_scope": "head"``, the default; OLMo-core's
  ``use_head_qk_norm``) or over all heads at once (``"qk_norm_scope": "full"``: OLMo 3's hybrid and transformers'
  ``olmo_hybrid``); ``"attn_impl"``: the softpick family (flame.models.common.choices.ATTN_IMPLS).
- ``"norm_order": "pre"`` (default) or ``"post"``: where the attention layers' two block norms sit, around the
  branch input (``x + attn(norm(x))``, then ``x + mlp(norm(x))``) or on the branch output
  (``x + norm(attn(x))``, then ``x + norm(mlp(x))``: OLMo 2/3's reordered norm,
  flame.models.common.choices.NORM_ORDERS). The family's own layers stay pre-norm.

FLA's config class keeps unknown keys and ignores them, so flame's keys do not break loading there, but FLA's hybrid
attention has none of them: FLA would build a different model (flame's export says so).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from flame.errors import ModelConfigError
from flame.models.common.args import ModelArgs
from flame.models.common.choices import NORM_ORDERS, check_attn_impl, check_qk_norm_scope


@dataclass(frozen=True)
class AttentionSpec:
    layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    qkv_bias: bool = False
    window_size: int | None = None
    rope_theta: float = 10000.0
    qk_norm: bool = False
    attn_impl: str = "parallel_attn"
    qk_norm_scope: str = "head"
    norm_order: str = "pre"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layers": list(self.layers)}


SPEC_KEYS = {f.name for f in dataclasses.fields(AttentionSpec)} | {"every", "offset"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any, field: str) -> int:
    if not _is_int(value) or value <= 0:
        raise ModelConfigError(f"{field} must be a positive integer, got {value!r}")
    return value


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ModelConfigError(f"{field} must be true or false, got {value!r}")
    return value


def _select_layers(spec: dict, name: str, num_layers: int) -> tuple[int, ...]:
    if ("layers" in spec) == ("every" in spec):
        raise ModelConfigError(
            f"{name}: give either 'layers' (a list of layer indices) or 'every' (and 'offset')"
        )
    if "every" not in spec:
        if "offset" in spec:
            raise ModelConfigError(
                f"{name}.offset only goes with 'every'; remove it or use 'every' for a pattern"
            )
        layers = spec["layers"]
        if not isinstance(layers, list) or not all(_is_int(i) for i in layers):
            raise ModelConfigError(f"{name}.layers must be a list of integer layer indices, got {layers!r}")
        for i in layers:
            if not 0 <= i < num_layers:
                raise ModelConfigError(
                    f"{name}.layers: layer {i} is outside [0, {num_layers}) (num_hidden_layers)"
                )
        if len(set(layers)) != len(layers):
            raise ModelConfigError(f"{name}.layers lists a layer twice: {layers}")
        return tuple(layers)
    every = _positive_int(spec["every"], f"{name}.every")
    offset = spec.get("offset", 0)
    if not _is_int(offset) or not 0 <= offset < every:
        raise ModelConfigError(f"{name}.offset must be an integer in [0, {every}) (every), got {offset!r}")
    if offset >= num_layers:
        raise ModelConfigError(f"{name}.offset {offset} selects no layer: num_hidden_layers is {num_layers}")
    return tuple(range(offset, num_layers, every))


def _parse_spec(spec: Any, name: str, num_layers: int, hidden_size: int) -> AttentionSpec:
    if not isinstance(spec, dict):
        raise ModelConfigError(f"{name} must be a dict of attention options, got {spec!r}")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ModelConfigError(
            f"{name}.{unknown[0]} is not an attention option; known: {', '.join(sorted(SPEC_KEYS))}"
        )
    layers = _select_layers(spec, name, num_layers)
    num_heads = _positive_int(spec.get("num_heads"), f"{name}.num_heads")
    if hidden_size % num_heads:
        raise ModelConfigError(
            f"{name}.num_heads: hidden_size {hidden_size} is not divisible by {num_heads} "
            "(attention head_dim = hidden_size // num_heads)"
        )
    if (hidden_size // num_heads) % 2:
        raise ModelConfigError(
            f"{name}.num_heads: head_dim = hidden_size // num_heads = {hidden_size // num_heads} must be even (RoPE)"
        )
    num_kv_heads = spec.get("num_kv_heads")
    num_kv_heads = num_heads if num_kv_heads is None else _positive_int(num_kv_heads, f"{name}.num_kv_heads")
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"{name}.num_kv_heads: num_heads {num_heads} is not divisible by {num_kv_heads}"
        )
    window_size = spec.get("window_size")
    if window_size is not None:
        _positive_int(window_size, f"{name}.window_size")
    rope_theta = spec.get("rope_theta", AttentionSpec.rope_theta)
    if (
        isinstance(rope_theta, bool)
        or not isinstance(rope_theta, (int, float))
        or not 0 < rope_theta < math.inf
    ):
        raise ModelConfigError(f"{name}.rope_theta must be a positive number, got {rope_theta!r}")
    attn_impl = spec.get("attn_impl", AttentionSpec.attn_impl)
    try:
        check_attn_impl(attn_impl)
    except ModelConfigError as e:
        raise ModelConfigError(f"{name}.{e}") from e
    qk_norm = _bool(spec.get("qk_norm", False), f"{name}.qk_norm")
    qk_norm_scope = spec.get("qk_norm_scope", AttentionSpec.qk_norm_scope)
    try:
        check_qk_norm_scope(qk_norm_scope)
    except ModelConfigError as e:
        raise ModelConfigError(f"{name}.{e}") from e
    if qk_norm_scope != AttentionSpec.qk_norm_scope and not qk_norm:
        raise ModelConfigError(f'{name}.qk_norm_scope {qk_norm_scope!r} needs "qk_norm": true')
    norm_order = spec.get("norm_order", AttentionSpec.norm_order)
    if norm_order not in NORM_ORDERS:
        raise ModelConfigError(
            f"{name}.norm_order must be one of {', '.join(NORM_ORDERS)}, got {norm_order!r}"
        )
    return AttentionSpec(
        layers=layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        qkv_bias=_bool(spec.get("qkv_bias", False), f"{name}.qkv_bias"),
        window_size=window_size,
        rope_theta=float(rope_theta),
        qk_norm=qk_norm,
        attn_impl=attn_impl,
        qk_norm_scope=qk_norm_scope,
        norm_order=norm_order,
    )


def parse_attn(attn: Any, num_layers: int, hidden_size: int) -> list[AttentionSpec]:
    """The attention specs of an ``attn`` value (None, a dict or a list of dicts); ModelConfigError if invalid."""
    if attn is None:
        return []
    if isinstance(attn, dict):
        named = [("attn", attn)]
    elif isinstance(attn, list):
        named = [(f"attn[{i}]", spec) for i, spec in enumerate(attn)]
    else:
        raise ModelConfigError(f"attn must be null, a dict or a list of dicts, got {attn!r}")
    specs, owner = [], {}
    for name, spec in named:
        parsed = _parse_spec(spec, name, num_layers, hidden_size)
        for i in parsed.layers:
            if i in owner:
                raise ModelConfigError(
                    f"{name}.layers: layer {i} is already an attention layer of {owner[i]}"
                )
            owner[i] = name
        specs.append(parsed)
    return specs


@dataclass
class HybridModelArgs(ModelArgs):
    """Args of a linear-attention family whose ``attn`` field can put attention at some layers."""

    attn: dict | list | None = None

    def validate(self) -> None:
        super().validate()
        specs = [spec.to_dict() for spec in parse_attn(self.attn, self.num_hidden_layers, self.hidden_size)]
        # Normalised to FLA's spelling (explicit layers, defaults filled), keeping the dict-or-list shape.
        self.attn = specs[0] if isinstance(self.attn, dict) else (specs or None)

    def attention_spec(self, layer_id: int) -> AttentionSpec | None:
        """The attention spec of a layer, or None where the family's own mixer runs."""
        for spec in parse_attn(self.attn, self.num_hidden_layers, self.hidden_size):
            if layer_id in spec.layers:
                return spec
        return None

    def layer_flops_per_token(self, seq_len: int) -> int:
        # Attention layers counted as the transformer family counts them (full square, x3 for backward), the
        # other layers with the family's own mixer term (flame.models.common.flops).
        total, attention_layers = 0, 0
        for spec in parse_attn(self.attn, self.num_hidden_layers, self.hidden_size):
            context = min(seq_len, spec.window_size) if spec.window_size else seq_len
            total += 12 * len(spec.layers) * self.hidden_size * context
            attention_layers += len(spec.layers)
        return total + (self.num_hidden_layers - attention_layers) * self.mixer_flops_per_token()

    def mixer_flops_per_token(self) -> int:
        """Training FLOPs per token of one layer of the family's own mixer, beyond its parameters."""
        return 0
