"""The transformer: every block mixes with attention."""

from torch import nn

from flame.models.common.decoder import Block, DecoderLM
from flame.models.layers.attention import Attention
from flame.models.transformer.args import TransformerArgs


class Transformer(DecoderLM):
    args: TransformerArgs

    def build_block(self, layer_id: int) -> nn.Module:
        args = self.args
        attention = Attention(
            hidden_size=args.hidden_size,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            qkv_bias=args.qkv_bias,
            qk_norm=args.qk_norm,
            window_size=args.window_size,
            rope_theta=args.rope_theta,
            attn_impl=args.attn_impl,
            norm_eps=args.norm_eps,
        )
        return Block(args, attention)
