"""flame's HF model classes: a ``PreTrainedModel`` around flame's own DecoderLM (the training model's code, so
the logits are the training model's: FLA's Triton kernels on CUDA, PyTorch elsewhere).

Parameter names are FLA's (``model.`` + flame's name, ``lm_head``). There is no KV cache: ``generate`` recomputes
the whole sequence at every step, which is what in-loop samples and small evaluations need. Padding is not
supported (flame's models take no attention mask): batches must hold sequences of one length.
"""

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from flame.hf.configuration import (
    FlameConfig,
    FlameDeltaNetConfig,
    FlameGatedDeltaNetConfig,
    FlameTransformerConfig,
)
from flame.loss import labelled_tokens, loss_sums
from flame.models import build_model


class FlamePreTrainedModel(PreTrainedModel):
    config_class = FlameConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Weights missing from a checkpoint get flame's initialisation (the generic pass of DecoderLM).
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
            super()._init_weights(module)
        elif module is not self and hasattr(module, "reset_parameters"):
            direct = list(module.parameters(recurse=False))
            if direct and not any(getattr(p, "_is_hf_initialized", False) for p in direct):
                module.reset_parameters()


class FlameForCausalLM(FlamePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: FlameConfig):
        super().__init__(config)
        decoder = build_model(config.flame_args())
        self.lm_head = decoder.lm_head
        decoder.lm_head = None  # DecoderLM then returns the final hidden states
        self.model = decoder
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "flame's models take no attention mask: pass sequences of one length, without padding"
            )
        hidden = self.model(input_ids, position_ids=position_ids)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            # HF's convention: labels are the inputs, shifted here (flame's own batches come shifted already).
            cross_entropy, _ = loss_sums(logits[:, :-1], labels[:, 1:], z_loss=False)
            loss = cross_entropy / labelled_tokens(labels[:, 1:])
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, attention_mask=None, **kwargs
    ) -> dict:
        return {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": 1}


class FlameTransformerForCausalLM(FlameForCausalLM):
    config_class = FlameTransformerConfig


class FlameGatedDeltaNetForCausalLM(FlameForCausalLM):
    config_class = FlameGatedDeltaNetConfig


class FlameDeltaNetForCausalLM(FlameForCausalLM):
    config_class = FlameDeltaNetConfig


MODEL_CLASSES = (FlameTransformerForCausalLM, FlameGatedDeltaNetForCausalLM, FlameDeltaNetForCausalLM)
