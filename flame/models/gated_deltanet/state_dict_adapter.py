"""Gated DeltaNet's HF formats: FLA's ``gated_deltanet``, flame's ``flame_gated_deltanet``, and transformers'
``olmo_hybrid`` where the architecture matches.

OLMo hybrid's linear-attention blocks are flame's (pre-norm Gated DeltaNet block, SwiGLU MLP): same projections,
decay and beta, in-kernel l2 norm of q/k, gated RMSNorm on the output (eps fixed at 1e-5); its q/k/v short
convolutions are one depthwise conv over the concatenated channels, which is flame's three convolutions stacked.
Its attention blocks differ from flame's: OLMo applies the norms after the mixer and after the MLP (``x + norm(f(x))``)
and normalises q and k over all heads at once, where flame's blocks are pre-norm with a per-head q/k norm. The two
compute different functions for the same weights, and transformers' class requires at least one attention layer,
so ``--format olmo_hybrid`` refuses every model flame builds today; ``olmo_linear_layer_to_hf`` is the mapping of
the blocks that do match.
"""

from typing import Any

import torch

from flame.models.common.state_dict_adapter import (
    FlaAdapter,
    FlameAdapter,
    State,
    StateDictAdapter,
    hybrid_fla_incompatibilities,
)
from flame.models.gated_deltanet.args import GatedDeltaNetArgs

# OLMo hybrid's output norm eps (FLA's FusedRMSNormGated default), independent of rms_norm_eps.
OLMO_OUTPUT_NORM_EPS = 1e-5


class GatedDeltaNetFlaAdapter(FlaAdapter):
    architecture = "GatedDeltaNetForCausalLM"

    def incompatibilities(self) -> list[str]:
        return hybrid_fla_incompatibilities(self.args)


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
    if args.num_v_heads not in (None, args.num_heads):
        problems.append("num_v_heads != num_heads (OLMo's layers have no grouped value heads)")
    if args.norm_eps != OLMO_OUTPUT_NORM_EPS:
        problems.append(
            f"norm_eps {args.norm_eps}: OLMo's output norm uses {OLMO_OUTPUT_NORM_EPS} and the block norms "
            "rms_norm_eps, flame one norm_eps for both"
        )
    return problems


def olmo_linear_layer_to_hf(layer: State, prefix: str = "") -> State:
    """One flame Gated DeltaNet block's tensors (names inside the block) under OLMo hybrid's names."""
    hf = {
        f"{prefix}input_layernorm.weight": layer["attn_norm.weight"],
        f"{prefix}post_attention_layernorm.weight": layer["mlp_norm.weight"],
        f"{prefix}linear_attn.conv1d.weight": torch.cat(
            [layer[f"attn.{x}_conv1d.weight"] for x in "qkv"], dim=0
        ),
    }
    for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj", "o_norm"):
        hf[f"{prefix}linear_attn.{name}.weight"] = layer[f"attn.{name}.weight"]
    for name in ("A_log", "dt_bias"):
        hf[f"{prefix}linear_attn.{name}"] = layer[f"attn.{name}"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        hf[f"{prefix}mlp.{name}.weight"] = layer[f"mlp.{name}.weight"]
    return hf


class OlmoHybridAdapter(StateDictAdapter):
    format = "olmo_hybrid"

    def incompatibilities(self) -> list[str]:
        args: GatedDeltaNetArgs = self.args
        problems = olmo_linear_incompatibilities(args)
        attention_layers = [i for i in range(args.num_hidden_layers) if args.attention_spec(i) is not None]
        if attention_layers:
            problems.append(
                f"attention layers {attention_layers} are pre-norm with per-head q/k norm in flame, post-norm with "
                "full-width q/k norm in OLMo hybrid (different functions of the same weights)"
            )
        else:
            problems.append("olmo_hybrid needs at least one attention layer")
        return problems

    def hf_config(self) -> dict[str, Any]:
        raise NotImplementedError("unreachable: every flame model is refused (see incompatibilities)")

    def to_hf(self, state_dict: State) -> State:
        raise NotImplementedError("unreachable: every flame model is refused (see incompatibilities)")

    def from_hf(self, hf_state_dict: State) -> State:
        raise NotImplementedError("unreachable: every flame model is refused (see incompatibilities)")


ADAPTERS = {
    "fla": GatedDeltaNetFlaAdapter,
    "flame": GatedDeltaNetFlameAdapter,
    "olmo_hybrid": OlmoHybridAdapter,
}
