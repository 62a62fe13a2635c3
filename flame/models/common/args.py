"""Model arguments read from an HF-style config JSON whose fields match FLA's config classes.

Each family subclasses :class:`ModelArgs` with its own fields; ``from_dict`` keeps the fields the family knows,
ignores HF bookkeeping and FLA's kernel-fusion switches (flame picks kernels per device) except
``fuse_linear_cross_entropy``, which flame's families honour, and reports the rest.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from flame.errors import ModelConfigError

# Keys that HF/FLA write into config files and that do not change the architecture flame builds.
IGNORED_KEYS = {
    "model_type", "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache", "pad_token_id",
    "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "use_l2warp", "hidden_act",
    "elementwise_affine", "keys_to_ignore_at_inference", "output_attentions", "output_hidden_states",
    "return_dict", "auto_map", "attnres_block_size", "norm_first",
    # FLA config keys that leave the architecture alone: "attn_mode" (a kernel choice; flame trains the chunked
    # form), DeltaNet's "use_output_norm" (FLA's layer never reads it), the legacy "attention_bias" of flame's configs.
    "attn_mode", "use_output_norm", "attention_bias",
}  # fmt: skip


@dataclass
class ModelArgs:
    model_type: ClassVar[str] = ""
    # Built from the class transformers registers for model_type (flame.models.generic), not by flame's family.
    generic: ClassVar[bool] = False

    vocab_size: int = 32000
    hidden_size: int = 2048
    num_hidden_layers: int = 24
    hidden_ratio: float | None = 4
    intermediate_size: int | None = None
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # Training computes the loss from the final hidden states and lm_head's weight chunk by chunk, never holding
    # the whole batch's logits (flame/ops/linear_cross_entropy.py); FLA's key of the same meaning.
    fuse_linear_cross_entropy: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> tuple["ModelArgs", list[str]]:
        """Build args from a config dict; returns (args, keys that were not understood)."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in config.items() if k in names}
        unknown = sorted(k for k in config if k not in names and k not in IGNORED_KEYS)
        args = cls(**known)
        args.validate()
        return args, unknown

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, **dataclasses.asdict(self)}

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.fuse_linear_cross_entropy, bool):
            raise ModelConfigError(
                f"fuse_linear_cross_entropy must be true or false, got {self.fuse_linear_cross_entropy!r}"
            )

    def layer_flops_per_token(self, seq_len: int) -> int:
        """Sequence-mixing FLOPs per token (forward + backward) that parameters do not account for."""
        return 0

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameter count and training FLOPs per token: 6 x non-embedding params + the mixers' own terms."""
        nparams = sum(p.numel() for p in model.parameters())
        # The embedding lookup costs no FLOPs; a tied matrix still does the lm head's matmul.
        dense = nparams if self.tie_word_embeddings else nparams - model.embeddings.weight.numel()
        return nparams, 6 * dense + self.layer_flops_per_token(seq_len)


def require_positive_int(args: ModelArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")


def require_divisible(numerator: int, denominator: int, what: str) -> None:
    if denominator <= 0 or numerator % denominator != 0:
        raise ModelConfigError(f"{what}: {numerator} is not divisible by {denominator}")
