"""An example of your own model for flame: a package written only against transformers, registered with its Auto
classes on import. Train it with

    bash train.sh --experimental.custom_model_path examples/custom_models \\
        --model.config examples/custom_models/decay_attn.json

(docs/models.md, "Your own model")."""

from transformers import AutoConfig, AutoModelForCausalLM

from custom_models.decay_attn import DecayAttnConfig, DecayAttnForCausalLM

AutoConfig.register(DecayAttnConfig.model_type, DecayAttnConfig)
AutoModelForCausalLM.register(DecayAttnConfig, DecayAttnForCausalLM)

__all__ = ["DecayAttnConfig", "DecayAttnForCausalLM"]
