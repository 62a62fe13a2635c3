"""flame's HF model classes: a ``PreTrainedModel`` around flame's own DecoderLM (the training model's code, so
the logits are the training model's: FLA's Triton kernels on CUDA, PyTorch elsewhere).

Parameter names are FLA's (``model.`` + flame's name, ``lm_head``). ``generate`` keeps a :class:`FlameCache`
(attention keys and values, recurrent states and short-convolution inputs per layer), so each step runs only the
new tokens. Padded batches (``attention_mask`` with 0 at left or right padding) give each row the logits it has
alone: padded keys are hidden from attention and padded tokens leave recurrent states unchanged
(flame.models.layers.decoding); positions count real tokens only.
"""

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from flame.hf import register_models
from flame.hf.configuration import (
    CONFIG_CLASSES,
    FlameConfig,
    FlameDeltaNetConfig,
    FlameGatedDeltaNetConfig,
    FlameTransformerConfig,
)
from flame.loss import labelled_tokens, loss_sums
from flame.models import build_model
from flame.models.layers.decoding import MixerCache

# transformers renamed the output's cache field from past_key_values to cache (5.2x); write the one it has.
CACHE_FIELD = next(
    name
    for name in ("cache", "past_key_values")
    if name in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
)


class FlameCache(Cache):
    """Per-layer state of flame's models for incremental decoding (flame.models.layers.decoding.MixerCache), on
    transformers' Cache interface as far as generate uses it: the number of tokens seen and batch reordering."""

    def __init__(self):
        super().__init__(layers=[])
        self.mixers: dict[int, MixerCache] = {}
        self.seen_tokens = 0

    def mixer(self, layer: int) -> MixerCache:
        return self.mixers.setdefault(layer, MixerCache())

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for mixer in self.mixers.values():
            mixer.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for mixer in self.mixers.values():
            mixer.map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        for mixer in self.mixers.values():
            mixer.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))


def run_block(block: nn.Module, x: torch.Tensor, position_ids, attention_mask, cache) -> torch.Tensor:
    """flame's Block.forward with the mixer's inference arguments (the norm orders of flame.models.common.decoder)."""
    mix = block.attn
    if block.norm_order == "post":
        x = x + block.attn_norm(mix(x, position_ids, attention_mask=attention_mask, cache=cache))
        return x + block.mlp_norm(block.mlp(x))
    x = x + mix(block.attn_norm(x), position_ids, attention_mask=attention_mask, cache=cache)
    return x + block.mlp(block.mlp_norm(x))


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

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate gets a FlameCache from prepare_inputs_for_generation instead

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        cache: FlameCache | None = None,
        use_cache: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``attention_mask`` [B, Tpast + T] covers the cached tokens and these; ``cache`` (or ``use_cache`` for a
        new one) continues from and records the state, returned in the output."""
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if cache is None and use_cache:
            cache = FlameCache()
        if cache is not None and not isinstance(cache, FlameCache):
            raise TypeError(f"flame's models keep a FlameCache, not a {type(cache).__name__}")
        batch, seq_len = input_ids.shape
        past_len = 0 if cache is None else cache.seen_tokens
        if attention_mask is not None:
            if attention_mask.shape != (batch, past_len + seq_len):
                raise ValueError(
                    f"attention_mask must be [batch, cached + new tokens] = {[batch, past_len + seq_len]}, "
                    f"got {list(attention_mask.shape)}"
                )
            attention_mask = None if bool(attention_mask.bool().all()) else attention_mask.bool()
        if position_ids is None:
            if attention_mask is not None:  # positions of real tokens, as if unpadded
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
            else:
                position_ids = torch.arange(past_len, past_len + seq_len, device=input_ids.device)
                position_ids = position_ids.expand(batch, -1)
        if cache is None and attention_mask is None:
            hidden = self.model(input_ids, position_ids=position_ids)  # the training model's forward
        else:
            hidden = self.model.embeddings(input_ids)
            for i, block in enumerate(self.model.layers.values()):
                layer_cache = None if cache is None else cache.mixer(i)
                hidden = run_block(block, hidden, position_ids, attention_mask, layer_cache)
            hidden = self.model.norm(hidden)
            if cache is not None:
                cache.seen_tokens += seq_len
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            # HF's convention: labels are the inputs, shifted here (flame's own batches come shifted already).
            cross_entropy, _ = loss_sums(logits[:, :-1], labels[:, 1:], z_loss=False)
            loss = cross_entropy / labelled_tokens(labels[:, 1:])
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: FlameCache | None = None,
        use_cache: bool = True,
        **kwargs,
    ) -> dict:
        cache = kwargs.get("past_key_values") if cache is None else cache
        if cache is None and use_cache:
            cache = FlameCache()
        if cache is not None:
            input_ids = input_ids[:, cache.seen_tokens :]  # only the tokens the cache has not seen
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "cache": cache,
            "logits_to_keep": 1,
        }


class FlameTransformerForCausalLM(FlameForCausalLM):
    config_class = FlameTransformerConfig


class FlameGatedDeltaNetForCausalLM(FlameForCausalLM):
    config_class = FlameGatedDeltaNetConfig


class FlameDeltaNetForCausalLM(FlameForCausalLM):
    config_class = FlameDeltaNetConfig


MODEL_CLASSES = (FlameTransformerForCausalLM, FlameGatedDeltaNetForCausalLM, FlameDeltaNetForCausalLM)


def from_export(
    path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> FlameForCausalLM:
    """flame's HF class with the weights of an HF folder of any format flame reads (flame.hf.formats: FLA's,
    flame's, llama, olmo_hybrid), in eval mode: the training model's code, on any device, whichever classes the
    folder's model_type names."""
    from flame.hf.formats import import_adapter
    from flame.hf.load import read_hf_config
    from flame.hf.safetensors_io import load_safetensors

    adapter = import_adapter(read_hf_config(Path(path)))
    values = {k: v for k, v in adapter.args.to_dict().items() if k != "model_type"}
    config_class, model_class = next(
        (c, m) for c, m in zip(CONFIG_CLASSES, MODEL_CLASSES) if c.family == adapter.args.model_type
    )
    with torch.device("meta"):
        model = model_class(config_class(**values))
    state = adapter.from_hf(load_safetensors(path))
    model.load_state_dict(
        {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in state.items()},
        assign=True,
        strict=True,
    )
    if adapter.args.tie_word_embeddings:
        model.lm_head.weight = model.model.embeddings.weight
    return model.to(device=device, dtype=dtype).eval()


# Importing this module first (before any flame config) gets here with the Auto classes not yet extended.
register_models()
