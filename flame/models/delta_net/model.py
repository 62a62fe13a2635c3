"""The DeltaNet model: DeltaNet mixers, with attention at the layers the ``attn`` field selects."""

from torch import nn

from flame.models.common.decoder import DecoderLM, build_hybrid_block
from flame.models.delta_net.args import DeltaNetArgs
from flame.models.layers.delta_net import DeltaNet


class DeltaNetModel(DecoderLM):
    """FLA initialises it with the generic pass only (no residual rescaling), which DecoderLM does."""

    args: DeltaNetArgs

    def build_block(self, layer_id: int) -> nn.Module:
        args = self.args
        return build_hybrid_block(
            args,
            layer_id,
            lambda: DeltaNet(
                hidden_size=args.hidden_size,
                num_heads=args.num_heads,
                expand_k=args.expand_k,
                expand_v=args.expand_v,
                use_beta=args.use_beta,
                use_gate=args.use_gate,
                use_short_conv=args.use_short_conv,
                conv_size=args.conv_size,
                allow_neg_eigval=args.allow_neg_eigval,
                qk_activation=args.qk_activation,
                qk_norm=args.qk_norm,
                norm_eps=args.norm_eps,
            ),
        )
