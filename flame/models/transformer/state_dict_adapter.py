"""The transformer's HF formats: FLA's ``transformer``, flame's ``flame_transformer``, transformers' ``llama``.

Llama computes what flame's transformer computes when every layer has the same shape and plain softmax attention:
same pre-norm blocks, RMSNorm with the weight after the float32 normalisation, rotate-half RoPE with the same
frequencies (so q/k weights need no permutation), GQA, SwiGLU. It has no q/k norm, sliding window, per-layer widths
or softpick scores, and its ``attention_bias`` would add an o_proj bias flame does not have: those are refused.
"""

from typing import Any

from flame.models.common.state_dict_adapter import (
    ExportError,
    FlaAdapter,
    FlameAdapter,
    RenameRules,
    State,
    StateDictAdapter,
    softmax_attention,
)
from flame.models.transformer.args import TransformerArgs

# FLA's RMSNorm default, which FLA's Attention uses for its q/k norms (flame uses norm_eps).
FLA_QK_NORM_EPS = 1e-5


class TransformerFlaAdapter(FlaAdapter):
    architecture = "TransformerForCausalLM"

    def incompatibilities(self) -> list[str]:
        args: TransformerArgs = self.args
        problems = []
        if not softmax_attention(args.attn_impl):
            problems.append(f"attn_impl {args.attn_impl} is flame's (FLA's transformer would run softmax)")
        if args.window_pattern is not None:
            problems.append("window_pattern is flame's")
        if args.layer_wise_scaling is not None:
            problems.append("layer_wise_scaling is flame's")
        if args.qk_norm and args.norm_eps != FLA_QK_NORM_EPS:
            problems.append(f"FLA's q/k norms use eps {FLA_QK_NORM_EPS}, this model norm_eps {args.norm_eps}")
        return problems


class TransformerFlameAdapter(FlameAdapter):
    architecture = "FlameTransformerForCausalLM"


LLAMA_NAMES = RenameRules(
    [
        ("embeddings.weight", "model.embed_tokens.weight"),
        ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
        ("layers.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
        ("layers.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
        ("layers.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
        ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
        ("layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        ("layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
        ("norm.weight", "model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]
)


class LlamaAdapter(StateDictAdapter):
    format = "llama"

    def incompatibilities(self) -> list[str]:
        args: TransformerArgs = self.args
        problems = []
        if not softmax_attention(args.attn_impl):
            problems.append(f"attn_impl {args.attn_impl} (Llama runs softmax attention)")
        if args.qk_norm:
            problems.append("qk_norm (Llama has no q/k norm)")
        if args.window_size is not None or args.window_pattern is not None:
            problems.append("a sliding window (Llama attends to the full context)")
        if args.layer_wise_scaling is not None:
            problems.append("layer_wise_scaling (Llama's layers all have one shape)")
        if args.qkv_bias:
            problems.append("qkv_bias (Llama's attention_bias also adds an o_proj bias)")
        return problems

    def hf_config(self) -> dict[str, Any]:
        args: TransformerArgs = self.args
        dims = args.layer_dims(0)
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": args.vocab_size,
            "hidden_size": args.hidden_size,
            "intermediate_size": dims.intermediate_size,
            "num_hidden_layers": args.num_hidden_layers,
            "num_attention_heads": dims.num_heads,
            "num_key_value_heads": dims.num_kv_heads,
            "head_dim": dims.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_position_embeddings,
            "initializer_range": args.initializer_range,
            "rms_norm_eps": args.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": args.tie_word_embeddings,
            "bos_token_id": args.bos_token_id,
            "eos_token_id": args.eos_token_id,
        }

    def to_hf(self, state_dict: State) -> State:
        hf = {}
        for key, value in state_dict.items():
            if key == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            name = LLAMA_NAMES.forward(key)
            if name is None:
                raise ExportError(f"{key} has no place in Llama's layout")
            hf[name] = value
        return hf

    def from_hf(self, hf_state_dict: State) -> State:
        state_dict = {}
        for key, value in hf_state_dict.items():
            name = LLAMA_NAMES.backward(key)
            if name is None:
                raise ExportError(f"{key} has no place in flame's transformer (a Llama feature flame lacks)")
            state_dict[name] = value
        return self._untie(state_dict)

    @staticmethod
    def args_from_hf_config(config: dict[str, Any]) -> TransformerArgs:
        """flame's transformer args for a Llama config.json; ExportError for Llama features flame lacks."""
        heads = config.get("num_attention_heads", 32)
        hidden = config.get("hidden_size", 4096)
        rope = config.get("rope_parameters") or {}
        problems = []
        if config.get("head_dim") not in (None, hidden // heads):
            problems.append(f"head_dim {config['head_dim']} != hidden_size // num_attention_heads")
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            problems.append(f"rope_type {rope.get('rope_type')} (flame has plain RoPE)")
        if config.get("attention_bias") or config.get("mlp_bias"):
            problems.append("attention_bias / mlp_bias")
        if config.get("hidden_act", "silu") not in ("silu", "swish"):
            problems.append(f"hidden_act {config.get('hidden_act')}")
        if problems:
            raise ExportError(f"flame cannot build this Llama model: {'; '.join(problems)}")
        args, _ = TransformerArgs.from_dict(
            {
                "vocab_size": config.get("vocab_size", 32000),
                "hidden_size": hidden,
                "intermediate_size": config.get("intermediate_size", 11008),
                "num_hidden_layers": config.get("num_hidden_layers", 32),
                "num_heads": heads,
                "num_kv_heads": config.get("num_key_value_heads"),
                "max_position_embeddings": config.get("max_position_embeddings", 2048),
                "initializer_range": config.get("initializer_range", 0.02),
                "norm_eps": config.get("rms_norm_eps", 1e-6),
                "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                "tie_word_embeddings": config.get("tie_word_embeddings", False),
                "bos_token_id": config.get("bos_token_id"),
                "eos_token_id": config.get("eos_token_id"),
            }
        )
        return args


ADAPTERS = {"fla": TransformerFlaAdapter, "flame": TransformerFlameAdapter, "llama": LlamaAdapter}
