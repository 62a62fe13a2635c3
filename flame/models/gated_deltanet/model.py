"""The Gated DeltaNet model: Gated DeltaNet mixers, with attention at the layers the ``attn`` field selects."""

from torch import nn

from flame.models.common.decoder import DecoderLM, build_hybrid_block
from flame.models.gated_deltanet.args import GatedDeltaNetArgs
from flame.models.layers.gated_deltanet import GatedDeltaNet


class GatedDeltaNetModel(DecoderLM):
    """FLA initialises it with the generic pass only (no residual rescaling), which DecoderLM does."""

    args: GatedDeltaNetArgs

    def build_block(self, layer_id: int) -> nn.Module:
        args = self.args
        return build_hybrid_block(
            args,
            layer_id,
            lambda: GatedDeltaNet(
                hidden_size=args.hidden_size,
                head_dim=args.head_dim,
                num_heads=args.num_heads,
                num_v_heads=args.num_v_heads,
                expand_v=args.expand_v,
                use_gate=args.use_gate,
                use_short_conv=args.use_short_conv,
                conv_size=args.conv_size,
                allow_neg_eigval=args.allow_neg_eigval,
                norm_eps=args.output_norm_eps_or_default(),
                output_gate_activation=args.output_gate_activation,
            ),
        )
