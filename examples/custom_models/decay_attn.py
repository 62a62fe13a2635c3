"""Decayed linear attention (a RetNet-style mixer) in plain PyTorch: per head, token i reads
sum_{j<=i} gamma^(i-j) (q_i . k_j) v_j with a fixed decay gamma per head, computed here in its quadratic form
(a T x T decay mask), which is simple and exact; a recurrent or chunked form would be the fast one."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class DecayAttnConfig(PretrainedConfig):
    model_type = "decay_attn"

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 64,
        num_hidden_layers: int = 2,
        num_heads: int = 4,
        intermediate_size: int = 128,
        norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class DecayAttention(nn.Module):
    def __init__(self, config: DecayAttnConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (
            proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        # RetNet's decays, 1 - 2^(-5-h): head h looks back about 2^(5+h) tokens.
        heads = torch.arange(self.num_heads, device=x.device, dtype=torch.float32)
        log_gamma = torch.log1p(-torch.exp2(-5.0 - heads))
        positions = torch.arange(length, device=x.device, dtype=torch.float32)
        distance = positions[:, None] - positions[None, :]
        decay = torch.where(distance >= 0, torch.exp(log_gamma[:, None, None] * distance), 0.0)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5 * decay.to(q.dtype)
        out = (scores @ v).transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out)


class DecayAttnBlock(nn.Module):
    def __init__(self, config: DecayAttnConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = DecayAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DecayAttnPreTrainedModel(PreTrainedModel):
    config_class = DecayAttnConfig
    base_model_prefix = "model"
    # The block class: where FSDP, activation checkpointing and compile cut the model (flame reads it).
    _no_split_modules = ["DecayAttnBlock"]


class DecayAttnModel(DecayAttnPreTrainedModel):
    def __init__(self, config: DecayAttnConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecayAttnBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for block in self.layers:
            h = block(h)
        return self.norm(h)


class DecayAttnForCausalLM(DecayAttnPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DecayAttnConfig):
        super().__init__(config)
        self.model = DecayAttnModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,  # positions enter only through the decay's distances
        **kwargs,
    ) -> CausalLMOutputWithPast:
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)
