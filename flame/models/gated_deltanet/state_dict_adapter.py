"""Gated DeltaNet's HF formats: FLA's ``gated_deltanet``, flame's ``flame_gated_deltanet``, and transformers'
``olmo_hybrid`` where the architecture matches.

OLMo hybrid's linear-attention blocks are flame's (pre-norm Gated DeltaNet block, SwiGLU MLP): same projections,
decay and beta, in-kernel l2 norm of q/k, gated RMSNorm on the output (eps fixed at 1e-5, flame's
``output_norm_eps``). Its attention blocks are flame's attention layers with ``"norm_order": "post"`` (the block
norms on the branch outputs: ``post_attention_layernorm`` and ``post_feedforward_layernorm``) and
``"qk_norm_scope": "full"`` (q/k RMSNorm over all heads at once), softmax attention with RoPE over the full
context, no biases. One attention shape (heads, RoPE theta) serves every attention layer, and the layer pattern is
``layer_types``. Everything else (embeddings, final RMSNorm, optional tied lm head) is flame's.

The short convolutions are written as the released OLMo hybrid checkpoints hold them, one weight per q/k/v
(``linear_attn.q_conv1d.weight`` ...): transformers 5.6's class has those modules, and later versions (one
``conv1d`` over the concatenated channels) concatenate them on load (transformers' conversion_mapping). Reading an
``olmo_hybrid`` folder back accepts both layouts, splitting the convolution channels by the config's sizes (what
transformers >= 5.17's ``save_pretrained`` writes splits them in three equal parts), and the block norm names those
versions save (the released checkpoints' ``attention_layer_norm`` and ``feedforward_layer_norm``, which the class
renames on load to ``input_layernorm`` and ``post_attention_layernorm``: OLMO_SAVED_NORM_NAMES).
"""

import functools
import re
from typing import Any

import torch

from flame.models.common.choices import swiglu_intermediate_size
from flame.models.common.hybrid import parse_attn
from flame.models.common.state_dict_adapter import (
    ExportError,
    FlaAdapter,
    FlameAdapter,
    RenameRules,
    State,
    StateDictAdapter,
    hybrid_fla_incompatibilities,
    softmax_attention,
)
from flame.models.gated_deltanet.args import GatedDeltaNetArgs

# The block norms as transformers >= 5.17 saves them (its conversion_mapping for olmo_hybrid, applied in reverse on
# save) -> as its class and flame's rules name them.
OLMO_SAVED_NORM_NAMES = {
    ".attention_layer_norm.": ".input_layernorm.",
    ".feedforward_layer_norm.": ".post_attention_layernorm.",
}
OLMO_CONVOLUTION = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.linear_attn\.(?:(?P<which>[qkv])_)?conv1d\.weight"
)
# OLMo hybrid's output norm eps (FLA's FusedRMSNormGated default), independent of rms_norm_eps.
OLMO_OUTPUT_NORM_EPS = 1e-5


class GatedDeltaNetFlaAdapter(FlaAdapter):
    architecture = "GatedDeltaNetForCausalLM"

    def incompatibilities(self) -> list[str]:
        args: GatedDeltaNetArgs = self.args
        problems = hybrid_fla_incompatibilities(args)
        if args.output_norm_eps_or_default() != args.norm_eps:
            problems.append(f"output_norm_eps {args.output_norm_eps} is flame's (FLA's layers use norm_eps)")
        return problems


class GatedDeltaNetFlameAdapter(FlameAdapter):
    architecture = "FlameGatedDeltaNetForCausalLM"


def olmo_linear_incompatibilities(args: GatedDeltaNetArgs) -> list[str]:
    """Where flame's Gated DeltaNet blocks differ from OLMo hybrid's linear-attention blocks."""
    problems = []
    if not args.use_gate:
        problems.append("use_gate false (OLMo's layers always have the output gate)")
    if args.output_gate_activation not in ("swish", "silu"):
        problems.append(f"output_gate_activation {args.output_gate_activation} (OLMo gates with silu)")
    if not args.use_short_conv:
        problems.append("use_short_conv false (OLMo's layers always convolve)")
    if args.output_norm_eps_or_default() != OLMO_OUTPUT_NORM_EPS:
        problems.append(
            f"Gated DeltaNet output norm eps {args.output_norm_eps_or_default()} (OLMo's is "
            f"{OLMO_OUTPUT_NORM_EPS}; set output_norm_eps {OLMO_OUTPUT_NORM_EPS})"
        )
    return problems


def olmo_attention_incompatibilities(args: GatedDeltaNetArgs) -> list[str]:
    """Where the attention layers of a flame hybrid differ from OLMo hybrid's attention blocks."""
    specs = parse_attn(args.attn, args.num_hidden_layers, args.hidden_size)
    if not specs:
        return ["no attention layer (olmo_hybrid needs at least one)"]
    if sum(len(spec.layers) for spec in specs) == args.num_hidden_layers:
        return ["no Gated DeltaNet layer (olmo_hybrid needs at least one)"]
    problems = []
    shapes = {(spec.num_heads, spec.num_kv_heads, spec.rope_theta) for spec in specs}
    if len(shapes) > 1:
        problems.append(
            "attention specs differ in num_heads, num_kv_heads or rope_theta (OLMo's attention layers share one)"
        )
    for spec in specs:
        where = f"attention layers {list(spec.layers)}"
        if spec.norm_order != "post":
            problems.append(
                f"{where}: norm_order {spec.norm_order} (OLMo's attention blocks are norm_order post)"
            )
        if not spec.qk_norm or spec.qk_norm_scope != "full":
            what = f"qk_norm_scope {spec.qk_norm_scope}" if spec.qk_norm else "no qk_norm"
            problems.append(f"{where}: {what} (OLMo normalises q and k with qk_norm_scope full)")
        if spec.window_size is not None:
            problems.append(
                f"{where}: window_size {spec.window_size} (OLMo's attention sees the full context)"
            )
        if spec.qkv_bias:
            problems.append(f"{where}: qkv_bias (OLMo's attention_bias also adds an o_proj bias)")
        if not softmax_attention(spec.attn_impl):
            problems.append(f"{where}: attn_impl {spec.attn_impl} (OLMo runs softmax attention)")
    return problems


_MLP = [
    (f"layers.{{i}}.mlp.{n}.weight", f"model.layers.{{i}}.mlp.{n}.weight")
    for n in ("gate_proj", "up_proj", "down_proj")
]
OLMO_LINEAR_NAMES = RenameRules(
    [
        ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        *[
            (f"layers.{{i}}.attn.{x}_conv1d.weight", f"model.layers.{{i}}.linear_attn.{x}_conv1d.weight")
            for x in "qkv"
        ],
        *[
            (f"layers.{{i}}.attn.{n}.weight", f"model.layers.{{i}}.linear_attn.{n}.weight")
            for n in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj", "o_norm")
        ],
        ("layers.{i}.attn.A_log", "model.layers.{i}.linear_attn.A_log"),
        ("layers.{i}.attn.dt_bias", "model.layers.{i}.linear_attn.dt_bias"),
        *_MLP,
    ]
)
OLMO_ATTENTION_NAMES = RenameRules(
    [
        ("layers.{i}.attn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
        *[
            (f"layers.{{i}}.attn.{n}.weight", f"model.layers.{{i}}.self_attn.{n}.weight")
            for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        ],
        *_MLP,
    ]
)
OLMO_END_NAMES = RenameRules(
    [
        ("embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]
)


class OlmoHybridAdapter(StateDictAdapter):
    """transformers' ``OlmoHybridForCausalLM`` (no flame or FLA import needed to load it)."""

    format = "olmo_hybrid"

    def incompatibilities(self) -> list[str]:
        args: GatedDeltaNetArgs = self.args
        return olmo_linear_incompatibilities(args) + olmo_attention_incompatibilities(args)

    @functools.cached_property
    def _attention_layers(self) -> frozenset[int]:
        args: GatedDeltaNetArgs = self.args
        return frozenset(i for i in range(args.num_hidden_layers) if args.attention_spec(i) is not None)

    def hf_config(self) -> dict[str, Any]:
        args: GatedDeltaNetArgs = self.args
        spec = parse_attn(args.attn, args.num_hidden_layers, args.hidden_size)[0]
        attention = self._attention_layers
        return {
            "model_type": "olmo_hybrid",
            "architectures": ["OlmoHybridForCausalLM"],
            "vocab_size": args.vocab_size,
            "hidden_size": args.hidden_size,
            "intermediate_size": swiglu_intermediate_size(
                args.hidden_size, args.hidden_ratio, args.intermediate_size
            ),
            "num_hidden_layers": args.num_hidden_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "layer_types": [
                "full_attention" if i in attention else "linear_attention"
                for i in range(args.num_hidden_layers)
            ],
            "hidden_act": "silu",
            "max_position_embeddings": args.max_position_embeddings,
            "initializer_range": args.initializer_range,
            "rms_norm_eps": args.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "linear_num_key_heads": args.num_heads,
            "linear_num_value_heads": args.num_v_heads or args.num_heads,
            "linear_key_head_dim": args.head_dim,
            "linear_value_head_dim": round(args.head_dim * args.expand_v),
            "linear_conv_kernel_dim": args.conv_size,
            "linear_allow_neg_eigval": args.allow_neg_eigval,
            "tie_word_embeddings": args.tie_word_embeddings,
            "bos_token_id": args.bos_token_id,
            "eos_token_id": args.eos_token_id,
            # OlmoHybridConfig's default (dolma2's pad token) would be outside a smaller vocabulary.
            "pad_token_id": None,
        }

    def _rules(self, layer: int | None) -> RenameRules:
        if layer is None:
            return OLMO_END_NAMES
        return OLMO_ATTENTION_NAMES if layer in self._attention_layers else OLMO_LINEAR_NAMES

    @staticmethod
    def _layer(name: str) -> int | None:
        parts = name.removeprefix("model.").split(".")
        return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() else None

    def to_hf(self, state_dict: State) -> State:
        hf = {}
        for key, value in state_dict.items():
            if key == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            name = self._rules(self._layer(key)).forward(key)
            if name is None:
                raise ExportError(f"{key} has no place in OLMo hybrid's layout")
            hf[name] = value
        return hf

    def from_hf(self, hf_state_dict: State) -> State:
        args: GatedDeltaNetArgs = self.args
        key_dim = args.num_heads * args.head_dim
        state_dict, convolutions = {}, {}
        for key, value in hf_state_dict.items():
            for saved, loaded in OLMO_SAVED_NORM_NAMES.items():
                key = key.replace(saved, loaded)
            # One conv1d (transformers >= 5.17's module) or q/k/v_conv1d (the released checkpoints' names).
            if conv := OLMO_CONVOLUTION.fullmatch(key):
                convolutions.setdefault(conv["layer"], {})[conv["which"] or "qkv"] = value
                continue
            name = self._rules(self._layer(key)).backward(key)
            if name is None:
                raise ExportError(
                    f"{key} has no place in flame's hybrid Gated DeltaNet (an OLMo feature flame lacks)"
                )
            state_dict[name] = value
        for layer, pieces in convolutions.items():
            # Split by the config's sizes whatever the pieces' sizes: transformers >= 5.17 saves its fused
            # convolution in three equal chunks (its Concatenate's reverse is Chunk), which misplaces channels
            # whenever the value dimension differs from the key dimension; concatenated, they are right again.
            fused = pieces["qkv"] if "qkv" in pieces else torch.cat([pieces[x] for x in "qkv"])
            parts = fused.split([key_dim, key_dim, fused.shape[0] - 2 * key_dim], dim=0)
            state_dict.update({f"layers.{layer}.attn.{x}_conv1d.weight": t for x, t in zip("qkv", parts)})
        return self._untie(state_dict)

    @staticmethod
    def args_from_hf_config(config: dict[str, Any]) -> GatedDeltaNetArgs:
        """flame's args for an olmo_hybrid config.json; ExportError for OLMo hybrid features flame lacks."""
        from transformers import OlmoHybridConfig

        try:  # transformers fills OLMo's defaults and validates the values
            hf = OlmoHybridConfig(
                **{k: v for k, v in config.items() if k not in ("model_type", "architectures")}
            )
        except (TypeError, ValueError) as e:
            raise ExportError(f"not a valid olmo_hybrid config.json: {str(e).strip().splitlines()[0]}") from e
        rope = hf.rope_parameters or {}
        problems = []
        if rope.get("rope_theta") is None:
            problems.append("no RoPE (rope_theta null: NoPE attention, which flame lacks)")
        elif rope.get("rope_type", "default") != "default":
            problems.append(f"rope_type {rope.get('rope_type')} (flame has plain RoPE)")
        if getattr(hf, "head_dim", None) not in (None, hf.hidden_size // hf.num_attention_heads):
            problems.append("head_dim != hidden_size // num_attention_heads")
        if hf.attention_bias:
            problems.append("attention_bias")
        if hf.hidden_act not in ("silu", "swish"):
            problems.append(f"hidden_act {hf.hidden_act}")
        if set(hf.layer_types) - {"full_attention", "linear_attention"}:
            problems.append(
                f"layer types {sorted(set(hf.layer_types) - {'full_attention', 'linear_attention'})}"
            )
        if problems:
            raise ExportError(f"flame cannot build this olmo_hybrid model: {'; '.join(problems)}")
        attention = [i for i, kind in enumerate(hf.layer_types) if kind == "full_attention"]
        args, _ = GatedDeltaNetArgs.from_dict(
            {
                "vocab_size": hf.vocab_size,
                "hidden_size": hf.hidden_size,
                "intermediate_size": hf.intermediate_size,
                "num_hidden_layers": hf.num_hidden_layers,
                "num_heads": hf.linear_num_key_heads,
                "num_v_heads": hf.linear_num_value_heads,
                "head_dim": hf.linear_key_head_dim,
                "expand_v": hf.linear_value_head_dim / hf.linear_key_head_dim,
                "conv_size": hf.linear_conv_kernel_dim,
                "allow_neg_eigval": hf.linear_allow_neg_eigval,
                "output_norm_eps": OLMO_OUTPUT_NORM_EPS,
                "norm_eps": hf.rms_norm_eps,
                "max_position_embeddings": hf.max_position_embeddings,
                "initializer_range": hf.initializer_range,
                "tie_word_embeddings": hf.tie_word_embeddings,
                "bos_token_id": hf.bos_token_id,
                "eos_token_id": hf.eos_token_id,
                "attn": {
                    "layers": attention,
                    "num_heads": hf.num_attention_heads,
                    "num_kv_heads": hf.num_key_value_heads,
                    "rope_theta": float(rope["rope_theta"]),
                    "qk_norm": True,
                    "qk_norm_scope": "full",
                    "norm_order": "post",
                },
            }
        )
        return args


ADAPTERS = {
    "fla": GatedDeltaNetFlaAdapter,
    "flame": GatedDeltaNetFlameAdapter,
    "olmo_hybrid": OlmoHybridAdapter,
}
