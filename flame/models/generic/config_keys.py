"""No key of a generic-path config is silently dropped.

transformers' config classes take ``**kwargs`` and keep a key they have no parameter for as an attribute, which a
model may or may not read, so a misspelt or outdated key changes nothing and says nothing. ``settle_keys`` accepts a
key only when the class takes it, it is transformers' bookkeeping (HF_BOOKKEEPING) or a generation setting,
transformers' RoPE standardisation or the class's own code consumes it from ``**kwargs``, it is the attribute an FLA
class stores a parameter under (FLA_ATTRIBUTE_KEYS), an older FLA release's name of a parameter (FLA_RENAMED_KEYS,
read as the new name), a value that describes what the class builds anyway (FLA_SETTLED_KEYS for FLA 0.6.0's
classes, TRANSFORMERS_SETTLED_KEYS for the keys hub files of transformers' models carry), an attribute the class
derives from the other keys whose config value equals the derived one, or an attribute the model's code reads
(``getattr(config, "head_dim", ...)``); anything else is refused in one line naming the key, the class and what to
do (docs/models.md#config-keys). The keys of FLA's ``attn`` spec
(the hybrid layers' softmax attention) are checked the same way. A user's class that declares no parameters of its
own is passed every key: its model reads them as attributes.
"""

import functools
import importlib.util
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError

from flame.errors import ModelConfigError
from flame.models.common.args import HF_BOOKKEEPING, did_you_mean

# Popped from a config's kwargs by transformers' RoPE standardisation (RotaryEmbeddingConfigMixin
# .convert_rope_params_to_dict, transformers/modeling_rope_utils.py) into rope_parameters, for classes that have
# them: hub config.json files of Llama, Qwen3, OLMo2 and Mistral carry these keys.
ROPE_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor")

# The PRs that renamed the Mamba families' layer_norm_epsilon to norm_eps (first released in FLA 0.2.2; transformers'
# Mamba configs keep the old name) and their time_step_* parameters to dt_* (first released in FLA 0.5.0), in
# fla/models/mamba/configuration_mamba.py and fla/models/mamba2/configuration_mamba2.py.
MAMBA_NORM_EPS_RENAME = "FLA 0.2.2, PRs 375 and 376"
MAMBA_DT_RENAME = "FLA 0.5.0, PR 782"
# old name -> FLA 0.6.0's name, per model_type (FLA's classes only; transformers' own Mamba classes keep time_step_*).
FLA_RENAMED_KEYS: dict[str, dict[str, tuple[str, str]]] = {
    "gated_deltaproduct": {
        # fla/models/gated_deltaproduct/configuration_gated_deltaproduct.py; the layer's switch was renamed with it
        "use_gate": ("use_output_gate", "FLA 0.3.0, PR 513"),
    },
    "mamba": {
        "layer_norm_epsilon": ("norm_eps", MAMBA_NORM_EPS_RENAME),
        "time_step_rank": ("dt_rank", MAMBA_DT_RENAME),
        "time_step_scale": ("dt_scale", MAMBA_DT_RENAME),
        "time_step_min": ("dt_min", MAMBA_DT_RENAME),
        "time_step_max": ("dt_max", MAMBA_DT_RENAME),
        "time_step_init_scheme": ("dt_init_scheme", MAMBA_DT_RENAME),
        "time_step_floor": ("dt_init_floor", MAMBA_DT_RENAME),
    },
    "mamba2": {
        "layer_norm_epsilon": ("norm_eps", MAMBA_NORM_EPS_RENAME),
        "time_step_min": ("dt_min", MAMBA_DT_RENAME),
        "time_step_max": ("dt_max", MAMBA_DT_RENAME),
        "time_step_floor": ("dt_init_floor", MAMBA_DT_RENAME),
        "time_step_limit": ("dt_limit", MAMBA_DT_RENAME),
    },
}
# attribute -> the parameter it is stored from: ABC's and GSA's parameters are misspelt exapnd_k/exapnd_v
# (fla/models/{abc,gsa}/configuration_*.py since their first release) but are stored as expand_k/expand_v, the
# attributes their models read and to_dict writes; transformers sets a config.json's expand_k on that attribute.
FLA_ATTRIBUTE_KEYS: dict[str, dict[str, str]] = {
    model_type: {"expand_k": "exapnd_k", "expand_v": "exapnd_v"} for model_type in ("abc", "gsa")
}


@dataclass(frozen=True)
class SettledKey:
    """A key the class does not take whose ``accepted`` values (None: any) describe what the class does anyway;
    under ``only_if`` (a boolean key of the class), other values are accepted while that key is false; with
    ``same_as``, the value the config (or the class's default) gives that key, which the class reads instead."""

    accepted: tuple | None
    why: str
    only_if: str | None = None
    same_as: str | None = None


# Per model_type; "*" for every FLA class (a key the class takes itself is never looked up here).
FLA_SETTLED_KEYS: dict[str, dict[str, SettledKey]] = {
    "*": {
        "attention_bias": SettledKey(
            (False,), "FLA's attention reads qkv_bias for the q/k/v biases and has no o_proj bias"
        ),
        "share_conv_kernel": SettledKey(
            (False,),
            "FLA removed it before 0.1.0 (commit 629ae169): each of q, k and v has its own short convolution",
            only_if="use_short_conv",
        ),
    },
    "gsa": {
        "use_rope": SettledKey(
            (False,), "FLA's GSA has no rotary embedding (removed before 0.1.0, commit c03209a3)"
        ),
    },
    "mamba": {
        key: SettledKey(
            None,
            "transformers' MambaConfig picks the scan of its PyTorch path with it; FLA's Mamba runs its own kernels",
        )
        for key in ("use_mambapy", "use_associative_scan")
    },
    "mamba2": {
        "rms_norm": SettledKey(
            (True,),
            "FLA before 0.5.0 applied Mamba2's gated RMSNorm whatever rms_norm said; FLA 0.6.0's rmsnorm "
            "(default true) is the switch",
        ),
        "time_step_rank": SettledKey(
            None,
            "Mamba2 computes dt per head in in_proj, with no low-rank projection (FLA 0.5.0, PR 782, removed "
            "the unused key)",
        ),
    },
}
# Keys of hub config.json files as their publishers wrote them (for their own code, or from an older transformers)
# that transformers' class of the model_type does not take, per model_type.
TRANSFORMERS_SETTLED_KEYS: dict[str, dict[str, SettledKey]] = {
    "deepseek_v3": {
        "topk_method": SettledKey(("noaux_tc",), "transformers' router takes the bias-corrected group top-k"),
        "scoring_func": SettledKey(("sigmoid",), "transformers' router scores experts with a sigmoid"),
        "moe_layer_freq": SettledKey((1,), "every layer from first_k_dense_replace on is an MoE layer"),
        "ep_size": SettledKey(
            None, "DeepSeek's own code's expert-parallel degree; flame's parallelism flags lay out"
        ),
        "aux_loss_alpha": SettledKey(
            (0, 0.0), "transformers' DeepseekV3 trains without an auxiliary balance loss"
        ),
        "seq_aux": SettledKey((False,), "the auxiliary loss's form", only_if="aux_loss_alpha"),
    },
    "falcon": {
        # Falcon-7B's and -40B's files, from the model's first, remote-code release
        "apply_residual_connection_post_layernorm": SettledKey(
            (False,), "transformers' Falcon adds each residual to the layer's input, before its norm"
        ),
    },
    "gemma2": {
        "hidden_act": SettledKey(None, "Gemma 2 reads hidden_activation", same_as="hidden_activation"),
    },
    "gpt2": {"n_ctx": SettledKey(None, "GPT-2 reads n_positions", same_as="n_positions")},
    "llama": {
        # SmolLM's config.json, exported by nanotron
        "is_llama_config": SettledKey(None, "nanotron's export marker"),
        "rope_interleaved": SettledKey((False,), "transformers' Llama rotates the two halves of each head"),
    },
    "phi3": {"attention_bias": SettledKey((False,), "transformers' Phi-3 projections have no bias")},
    "qwen3_moe": {
        # Qwen2's key, in Qwen3-MoE's hub files: the layers past it keep full attention under sliding windows
        "max_window_layers": SettledKey(
            None,
            "transformers' Qwen3-MoE applies sliding_window to every layer",
            only_if="use_sliding_window",
        ),
    },
}
# Nested specs other than ``attn``, per model_type: the keys FLA's model reads from them.
FLA_NESTED_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    # fla/models/rodimus/modeling_rodimus.py builds its shared-key attention from these
    "rodimus": {"ska_attn": ("num_heads", "qkv_bias", "qk_norm", "window_size", "rope_theta")},
}
# Keys of an AttentionSpec that a family's blocks do not pass to their attention layers (fla/models/<type>/
# modeling_<type>.py), which then take Attention's default (fla/layers/attn.py).
FLA_UNREAD_ATTN_KEYS: dict[str, dict[str, Any]] = {
    "mom": {"qkv_bias": False, "rope_theta": 10000.0},
    "lightnet": {"rope_theta": 10000.0},
}


def accepted_keys(cls: type) -> set[str]:
    """Every key a config class's constructor takes, its own and its bases' (transformers passes **kwargs up)."""
    keys = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            keys |= set(inspect.signature(klass.__init__).parameters) - {"self", "kwargs"}
    return keys


@functools.cache
def generation_keys() -> frozenset[str]:
    """Generation settings older configs carry (max_length, temperature, ...; transformers 5 drops these from a model
    config, PreTrainedConfig.__init__) and those GenerationConfig.from_model_config takes from one (Gemma 3's
    cache_implementation): they never change the model that trains."""
    from transformers import GenerationConfig

    settings = {key for key in vars(GenerationConfig()) if not key.startswith("_")}
    return frozenset(GenerationConfig._get_default_generation_params()) | settings


@functools.cache
def shared_config_bases() -> frozenset[type]:
    """PreTrainedConfig and its mixins: every config class has them, whatever its model reads."""
    from transformers import PretrainedConfig

    return frozenset(PretrainedConfig.__mro__)


@functools.cache
def class_source(klass: type) -> str:
    try:
        return inspect.getsource(klass)
    except (OSError, TypeError):  # defined in a REPL or a C extension: nothing to read
        return ""


@functools.cache
def modeling_source(cls: type) -> str:
    """The source of the model module beside the config class's (configuration_x.py -> modeling_x.py), or ""."""
    module = cls.__module__.replace(".configuration_", ".modeling_")
    try:
        spec = importlib.util.find_spec(module) if module != cls.__module__ else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    return Path(spec.origin).read_text()


def model_reads(cls: type, key: str) -> bool:
    """Whether the model's code reads the config attribute ``key`` (``config.head_dim``, ``getattr(config,
    "head_dim", ...)``): transformers keeps a key its class does not take as such an attribute, which many of its
    models read (Qwen3-MoE's, OLMo-2's and Phi-3's head_dim)."""
    quoted = rf"""["']{re.escape(key)}["']"""
    pattern = re.compile(rf"\bconfig\.{re.escape(key)}\b|getattr\(\s*(?:self\.)?config\s*,\s*{quoted}")
    return bool(pattern.search(modeling_source(cls)))


def reads_from_kwargs(cls: type, key: str) -> bool:
    """Whether the class's own code (not the bases every config shares) takes ``key`` out of its ``**kwargs``:
    transformers 5's config classes read keys of older hub files there (Gemma 3's sliding_window_pattern and
    rope_local_base_freq, in __post_init__ and its RoPE conversion)."""
    quoted = rf"""["']{re.escape(key)}["']"""
    pattern = re.compile(
        rf"kwargs\s*(?:\.\s*(?:get|pop)\(\s*|\[\s*){quoted}|{quoted}\s+(?:not\s+)?in\s+kwargs\b"
    )
    return any(pattern.search(class_source(k)) for k in cls.__mro__ if k not in shared_config_bases())


def declares_no_keys(cls: type) -> bool:
    """A user's config class with no parameters of its own beyond PreTrainedConfig's: transformers keeps every key
    given as an attribute, which its model may read, so which keys matter is the model's secret."""
    from transformers import PretrainedConfig

    if cls.__module__.partition(".")[0] in ("fla", "transformers"):
        return False
    return accepted_keys(cls) <= accepted_keys(PretrainedConfig)


def describe(cls: type) -> str:
    owner = {"fla": "FLA's ", "transformers": "transformers' "}.get(cls.__module__.partition(".")[0], "")
    return f"{owner}{cls.__name__}"


def same(a: Any, b: Any) -> bool:
    """Equal as JSON (a config's list and a class's tuple are the same value)."""
    try:
        return json.loads(json.dumps(a)) == json.loads(json.dumps(b))
    except (TypeError, ValueError):
        return a == b


def default_of(cls: type, key: str) -> Any:
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            parameter = inspect.signature(klass.__init__).parameters.get(key)
            if parameter is not None:
                return parameter.default
    return None


def settle_keys(
    cls: type, model_type: str, values: dict[str, Any], alternative: type | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The config values for ``cls`` (older FLA names read as FLA 0.6.0's) and a notice per renamed key;
    ModelConfigError for a key ``cls`` would drop, naming ``alternative`` (transformers' own class of the
    model_type, which ``--model.impl hf`` builds) where that class takes the key."""
    taken = accepted_keys(cls)
    if declares_no_keys(cls):
        return dict(values), []
    fla = cls.__module__.startswith("fla.")
    renamed = FLA_RENAMED_KEYS.get(model_type, {}) if fla else {}
    aliases = FLA_ATTRIBUTE_KEYS.get(model_type, {}) if fla else {}
    if fla:
        settled = {**FLA_SETTLED_KEYS["*"], **FLA_SETTLED_KEYS.get(model_type, {})}
    elif cls.__module__.startswith("transformers."):
        settled = TRANSFORMERS_SETTLED_KEYS.get(model_type, {})
    else:
        settled = {}
    rope = hasattr(cls, "rope_parameters")
    values, notices, derived = dict(values), [], []
    for key, value in list(values.items()):
        if (
            key in taken
            or key in HF_BOOKKEEPING
            or (rope and key in ROPE_KEYS)
            or key in generation_keys()
            or reads_from_kwargs(cls, key)
        ):
            continue
        if key in renamed:
            new, where = renamed[key]
            if new in values and not same(values[new], value):
                raise ModelConfigError(
                    f"{key} {json.dumps(value)} and {new} {json.dumps(values[new])} disagree: {key} is {describe(cls)}'s "
                    f"{new} under its name before {where}; remove {key}"
                )
            values[new] = values.pop(key)
            notices.append(f"{key} is read as {new} ({describe(cls)}'s name for it since {where})")
        elif key in aliases:
            parameter = aliases[key]
            if parameter in values and not same(values[parameter], value):
                raise ModelConfigError(
                    f"{key} {json.dumps(value)} and {parameter} {json.dumps(values[parameter])} disagree: "
                    f"{describe(cls)} stores {parameter} as {key}, and the config's {key} wins; remove {parameter}"
                )
        elif key in settled:
            rule = settled[key]
            if rule.only_if and not values.get(rule.only_if, default_of(cls, rule.only_if)):
                continue
            if rule.accepted is None and rule.only_if:
                raise ModelConfigError(
                    f"{key} {json.dumps(value)}: {describe(cls)} does not take it ({rule.why}); remove it, or set "
                    f"{rule.only_if} to false"
                )
            if rule.same_as:
                read = values.get(rule.same_as, default_of(cls, rule.same_as))
                if same(value, read):
                    continue
                raise ModelConfigError(
                    f"{key} {json.dumps(value)} and {rule.same_as} {json.dumps(read)} disagree: {describe(cls)} "
                    f"does not take {key} ({rule.why}); remove {key} or set {rule.same_as} to {json.dumps(value)}"
                )
            if rule.accepted is None or any(same(value, a) for a in rule.accepted):
                continue
            raise ModelConfigError(
                f"{key} {json.dumps(value)}: {describe(cls)} does not take it ({rule.why}); remove it or set it "
                f"to {json.dumps(rule.accepted[0])}"
            )
        else:
            derived.append(key)
    if "attn" in taken and fla:
        from fla.models.configuration_utils import AttentionSpec

        known = tuple(AttentionSpec.__annotations__)
        check_nested(
            cls, "attn", values.get("attn"), known, FLA_UNREAD_ATTN_KEYS.get(model_type, {}), model_type
        )
    for name, known in (FLA_NESTED_KEYS.get(model_type, {}) if fla else {}).items():
        check_nested(cls, name, values.get(name), known, {}, model_type)
    if derived:
        check_derived(cls, values, derived, taken, alternative)
    return values, notices


def check_derived(
    cls: type, values: dict[str, Any], keys: list[str], taken: set[str], alternative: type | None = None
) -> None:
    """Accept the keys the class derives itself (an attribute of the class built without them) when the config's
    value is the derived one, and those its model reads as attributes."""
    try:
        built = cls(**{k: v for k, v in values.items() if k not in keys})
    except (TypeError, ValueError, StrictDataclassError):
        built = None  # the class refuses the rest of the config: nothing is derived, every key is unknown
    for key in keys:
        value = values[key]
        if built is not None and key in vars(built):  # a private one too (Gemma 3's _sliding_window_pattern)
            if same(vars(built)[key], value):
                continue
            raise ModelConfigError(
                f"{key} {json.dumps(value)}: {describe(cls)} derives {json.dumps(vars(built)[key])} from the "
                f"config's other keys and does not take {key}; remove it or set it to "
                f"{json.dumps(vars(built)[key])}"
            )
        if model_reads(cls, key):
            continue  # transformers keeps it as an attribute, which the model reads
        hint = did_you_mean(key, taken)
        other = (
            f", or pass --model.impl hf to train {describe(alternative)}'s model, which takes it"
            if alternative is not None and key in accepted_keys(alternative)
            else ""
        )
        raise ModelConfigError(
            f"{key} is not a key of {describe(cls)}{hint}: the class would ignore it; remove it or correct its "
            f"name{other} (docs/models.md#config-keys)"
        )


def check_nested(
    cls: type, name: str, value: Any, known: tuple[str, ...], unread: dict[str, Any], model_type: str
) -> None:
    """Every key of a nested spec (FLA's ``attn``: fla/models/configuration_utils.py's AttentionSpec, which FLA
    validates while keeping unknown keys) is one the model reads; ``unread``: keys its blocks leave at a default."""
    for spec in value if isinstance(value, list) else [value] if isinstance(value, dict) else []:
        if not isinstance(spec, dict):
            continue  # FLA's own check refuses it
        for key, item in spec.items():
            if key not in known:
                raise ModelConfigError(
                    f"{name}.{key} is not a key of {describe(cls)}'s {name} spec{did_you_mean(key, known)} (it reads "
                    f"{', '.join(known)}); remove it or correct its name"
                )
            if key in unread and not same(item, unread[key]):
                raise ModelConfigError(
                    f"{name}.{key} {json.dumps(item)}: {describe(cls)}'s blocks build their attention without "
                    f"{key} (fla/models/{model_type}/modeling_{model_type}.py), which is then "
                    f"{json.dumps(unread[key])}; remove it or set it to {json.dumps(unread[key])}"
                )
