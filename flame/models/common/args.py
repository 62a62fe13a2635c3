"""Model arguments read from an HF-style config JSON whose fields match FLA's config classes.

Each family subclasses :class:`ModelArgs` with its own fields (``fuse_linear_cross_entropy``, common to all, selects
the fused linear cross-entropy). No key of a config is silently dropped: ``from_dict``
takes the family's fields, passes the keys that do not change the model flame builds (IRRELEVANT_KEYS, each with
its reason), checks the values of the keys flame honours only for some settings (RESTRICTED_KEYS) and refuses
everything else, in one line naming the key and what to do.
"""

import dataclasses
import difflib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from flame.errors import ModelConfigError

if TYPE_CHECKING:  # args import no torch: train.sh's pre-flight checks a config without it
    from torch import nn

# What transformers writes into every config.json (its bookkeeping and the attributes of PreTrainedConfig that
# concern other heads, outputs and generation); no model reads them for its architecture.
HF_BOOKKEEPING = {
    "model_type": "picks the family",
    "_name_or_path": "where transformers loaded the config from",
    "architectures": "the class that saved the file",
    "transformers_version": "the version that saved the file",
    "dtype": "the dtype the weights were saved in; training precision is --training.mixed_precision_param",
    "torch_dtype": "the dtype the weights were saved in; training precision is --training.mixed_precision_param",
    "use_cache": "generation's key/value cache; training keeps none",
    "auto_map": "where remote code lives; flame builds its own classes",
    "keys_to_ignore_at_inference": "generation's outputs",
    "output_attentions": "what the HF forward returns",
    "output_hidden_states": "what the HF forward returns",
    "return_dict": "what the HF forward returns",
    "chunk_size_feed_forward": "a memory option of some HF feed-forward layers; flame's MLP runs whole",
    "id2label": "classification heads",
    "label2id": "classification heads",
    "problem_type": "classification heads",
    "is_encoder_decoder": "transformers' encoder-decoder models; flame's are decoders",
    "task_specific_params": "the settings of transformers' pipelines per task",
}
# Keys of FLA's config classes that leave the model flame's families build unchanged.
IRRELEVANT_KEYS = {
    **HF_BOOKKEEPING,
    "pad_token_id": "flame's data marks padding in the labels, not by a token id (FLA's class passes it to "
    "nn.Embedding as padding_idx, so that row gets no gradient there; flame trains every row)",
    "fuse_norm": "a kernel choice: FLA's fused and unfused RMSNorm compute the same function; flame picks its "
    "kernels per device",
    "fuse_swiglu": "a kernel choice: FLA's fused and unfused SwiGLU compute the same function; flame picks its "
    "kernels per device",
    "attn_mode": "a kernel choice (chunk, fused_recurrent: the same function); flame trains the chunked form",
    "fuse_cross_entropy": "a kernel choice: FLA's fused and unfused cross-entropy compute the same loss "
    "(fuse_linear_cross_entropy, a field, selects flame's fused linear cross-entropy)",
}


# transformers' names of parameters that FLA's and flame's configs spell otherwise: difflib alone points
# num_attention_heads at num_kv_heads.
KEY_SYNONYMS = {
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "rms_norm_eps": "norm_eps",
    "layer_norm_eps": "norm_eps",
    "layer_norm_epsilon": "norm_eps",
}


def did_you_mean(key: str, names: Iterable[str]) -> str:
    """`` (did you mean X?)`` with the name among ``names`` that ``key`` most likely meant, or ""."""
    names = sorted(names)
    near = (
        [KEY_SYNONYMS[key]] if KEY_SYNONYMS.get(key) in names else difflib.get_close_matches(key, names, n=1)
    )
    return f" (did you mean {near[0]}?)" if near else ""


@dataclass(frozen=True)
class RestrictedKey:
    """A key flame's families honour for ``accepted`` values only (as FLA means them); others are refused with
    ``why``. ``fla_reads``: the refused values FLA's class does build (the refusal then points to --model.impl fla);
    None for all of them."""

    accepted: tuple
    why: str
    fla_reads: tuple | None = ()

    def problem(self, key: str, value: Any) -> str | None:
        if any(value == a and type(value) is type(a) for a in self.accepted):
            return None
        if self.fla_reads is None or value in self.fla_reads:
            todo = "remove it, or use --model.impl fla to train FLA's class, which reads it"
        else:
            todo = f"remove it or set it to {json.dumps(self.accepted[0])}"
        return f"{key} {json.dumps(value)}: {self.why}; {todo}"


RESTRICTED_KEYS = {
    "hidden_act": RestrictedKey(
        ("swish", "silu"), "flame's MLP is SwiGLU (FLA's GatedMLP takes swish or powlu)", fla_reads=("powlu",)
    ),
    "attnres_block_size": RestrictedKey(
        (None,), "flame's blocks have no attention residuals (FLA's AttnRes)", fla_reads=None
    ),
    "elementwise_affine": RestrictedKey(
        (True, None), "flame's norms always have weights (FLA 0.6.0's too: its models never read this key)"
    ),
    "use_output_norm": RestrictedKey(
        (True,), "DeltaNet's output norm is always applied (FLA 0.6.0's layer never reads this key)"
    ),
    "attention_bias": RestrictedKey(
        (False,), "flame's and FLA's attention read qkv_bias for the q/k/v biases and have no o_proj bias"
    ),
    "norm_first": RestrictedKey((True,), "flame's blocks are pre-norm"),
}


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
    # FLA's key: the training loss pulls each position's largest logit towards 0 (flame/loss.py's l2_warp).
    use_l2warp: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> tuple["ModelArgs", list[str]]:
        """Build args from a config dict; every key is a field, irrelevant, or an accepted value of a restricted
        key, else ModelConfigError. Returns (args, []): no key is left over."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in config.items():
            if key in names or key in IRRELEVANT_KEYS:
                continue
            if key in RESTRICTED_KEYS:
                if problem := RESTRICTED_KEYS[key].problem(key, value):
                    raise ModelConfigError(problem)
                continue
            raise ModelConfigError(
                f"{key} is not a field of flame's {cls.model_type} model{did_you_mean(key, names)}; remove it or "
                "correct its name "
                "(docs/models.md lists the keys flame reads and those it passes over)"
            )
        args = cls(**{k: v for k, v in config.items() if k in names})
        args.validate()
        return args, []

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, **dataclasses.asdict(self)}

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("fuse_linear_cross_entropy", "use_l2warp"):
            if not isinstance(getattr(self, name), bool):
                raise ModelConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def layer_flops_per_token(self, seq_len: int) -> int:
        """Sequence-mixing FLOPs per token (forward + backward) that parameters do not account for."""
        return 0

    def get_nparams_and_flops(self, model: "nn.Module", seq_len: int) -> tuple[int, int]:
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
