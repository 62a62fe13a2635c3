"""The transformer: every block mixes with attention (per-layer windows and widths from the args)."""

from torch import nn

from flame.models.common.decoder import Block, DecoderLM
from flame.models.layers.attention import Attention
from flame.models.transformer.args import TransformerArgs


class Transformer(DecoderLM):
    args: TransformerArgs

    def build_block(self, layer_id: int) -> nn.Module:
        args = self.args
        dims = args.layer_dims(layer_id)
        attention = Attention(
            hidden_size=args.hidden_size,
            num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
            qkv_bias=args.qkv_bias,
            qk_norm=args.qk_norm,
            window_size=args.layer_window(layer_id),
            rope_theta=args.rope_theta,
            attn_impl=args.attn_impl,
            norm_eps=args.norm_eps,
        )
        return Block(args, attention, intermediate_size=dims.intermediate_size)
