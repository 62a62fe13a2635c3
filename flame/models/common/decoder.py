"""The decoder every family shares: embeddings -> residual blocks (pre-norm by default) -> norm -> lm head.

Module names follow FLA's HF models (``embeddings``, ``layers.<i>.attn_norm/attn/mlp_norm/mlp``, ``norm``,
``lm_head``) so conversion to and from FLA checkpoints is a prefix change. ``layers`` is a ModuleDict keyed by
the layer index, as in torchtitan, so pipeline stages keep the original names.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flame.models.common.args import ModelArgs
from flame.models.common.choices import NORM_ORDERS, swiglu_intermediate_size
from flame.models.common.hybrid import HybridModelArgs
from flame.models.layers.attention import Attention
from flame.models.layers.mlp import GatedMLP
from flame.models.layers.norm import RMSNorm
from flame.ops.linear_cross_entropy import linear_cross_entropy


class Block(nn.Module):
    """Residual block around one sequence mixer and a SwiGLU MLP, with the norms placed by ``norm_order``."""

    def __init__(
        self,
        args: ModelArgs,
        mixer: nn.Module,
        intermediate_size: int | None = None,
        norm_order: str = "pre",
    ):
        super().__init__()
        if norm_order not in NORM_ORDERS:
            raise ValueError(f"norm_order must be one of {NORM_ORDERS}, got {norm_order!r}")
        self.norm_order = norm_order
        self.attn_norm = RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.attn = mixer
        self.mlp_norm = RMSNorm(args.hidden_size, eps=args.norm_eps)
        size = intermediate_size or swiglu_intermediate_size(
            args.hidden_size, args.hidden_ratio, args.intermediate_size
        )
        self.mlp = GatedMLP(args.hidden_size, size)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.norm_order == "post":
            x = x + self.attn_norm(self.attn(x, position_ids, cu_seqlens))
            return x + self.mlp_norm(self.mlp(x))
        x = x + self.attn(self.attn_norm(x), position_ids, cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))


def build_hybrid_block(args: HybridModelArgs, layer_id: int, build_mixer: Callable[[], nn.Module]) -> Block:
    """The block of a layer: flame's Attention with its spec's norm order where the ``attn`` field selects the
    layer, else a pre-norm block around the family's own mixer (``build_mixer()``)."""
    spec = args.attention_spec(layer_id)
    if spec is None:
        return Block(args, build_mixer())
    attention = Attention(
        hidden_size=args.hidden_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        qk_norm_scope=spec.qk_norm_scope,
        window_size=spec.window_size,
        rope_theta=spec.rope_theta,
        attn_impl=spec.attn_impl,
        norm_eps=args.norm_eps,
    )
    return Block(args, attention, norm_order=spec.norm_order)


class LMHead(nn.Linear):
    """The output projection (no bias). ``lm_head(hidden)`` gives the logits; ``lm_head(hidden, labels, ...)`` the
    summed loss straight from the hidden states, chunk by chunk, without the logits of the whole batch
    (flame/ops/linear_cross_entropy.py: returns loss, cross_entropy, z_term). Either way the call goes through the
    module, so FSDP gathers the weight for it and reduces its gradient as for the logits."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        z_loss: float = 0.0,
        chunk_size: int | None = None,
        l2warp: float = 0.0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if labels is None:
            return F.linear(hidden, self.weight)
        return linear_cross_entropy(hidden, self.weight, labels, ignore_index, z_loss, chunk_size, l2warp)


def fuses_linear_cross_entropy(model: nn.Module) -> bool:
    """The model is one of flame's families, built with fuse_linear_cross_entropy: its loss comes from
    ``model(..., return_hidden=True)`` and ``model.lm_head(hidden, labels)``."""
    return isinstance(getattr(model, "lm_head", None), LMHead) and model.args.fuse_linear_cross_entropy


class DecoderLM(nn.Module):
    """Causal LM over a list of blocks. Families subclass it and implement ``build_block``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(args.num_hidden_layers)})
        self.norm = RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.lm_head = LMHead(args.hidden_size, args.vocab_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight

    def build_block(self, layer_id: int) -> nn.Module:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, vocab]; with ``return_hidden`` the final hidden states [B, T, hidden] (after the norm),
        for a loss that applies ``lm_head`` itself (``fuse_linear_cross_entropy``). ``cu_seqlens`` (with batch 1)
        marks packed documents; ``position_ids`` then restart per document. Stages of a pipeline may lack
        embeddings or lm_head (set to None)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(
                input_ids.shape[0], -1
            )
        h = self.embeddings(input_ids) if self.embeddings is not None else input_ids
        for block in self.layers.values():
            h = block(h, position_ids, cu_seqlens)
        h = self.norm(h) if self.norm is not None else h
        return h if return_hidden or self.lm_head is None else self.lm_head(h)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """FLA's initialisation: normal(0, initializer_range) for linear, conv and embedding weights, zero
        biases, then each module's own ``reset_parameters`` (norms, decay parameters ...)."""
        std = self.args.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        self.post_init_weights()

    def post_init_weights(self) -> None:
        """Family-specific re-initialisation after the generic pass (e.g. residual rescaling)."""
