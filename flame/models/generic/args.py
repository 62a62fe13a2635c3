"""Args of a generic-family model: the config JSON as written, read through the config class of the chosen
implementation (--model.impl: FLA's, transformers' own or a user's registered class) for its model_type."""

import functools
import importlib
import importlib.util
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from huggingface_hub.errors import StrictDataclassError
from torch import nn

from flame.errors import ModelConfigError, first_line
from flame.models import IMPL_KEY, custom
from flame.models.common.args import ModelArgs
from flame.models.common.module_flops import module_flops
from flame.models.generic.config_keys import settle_keys

# Written by flame into a generic model's config (flame.json, model_config.json), never into an HF export: the
# user modules that register its classes, imported again wherever the config is read (the HF converter after a run).
CUSTOM_IMPORTS_KEY = "flame_custom_imports"

logger = logging.getLogger(__name__)


def import_fla_models() -> None:
    """Registers FLA's model types with transformers' Auto classes (FLA's class replaces transformers' for the types
    both have)."""
    # FLA warns on import on machines without a GPU; the model is only built here, not run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.models  # noqa: F401


@functools.cache
def fla_model_types() -> frozenset[str]:
    """The model types FLA registers, read from its configuration modules' source (``model_type = '...'``) rather
    than by importing FLA, which takes seconds: auto asks this for every model_type transformers has itself."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    models = Path(spec.submodule_search_locations[0]) / "models"
    declared = re.compile(r"^\s+model_type\s*=\s*['\"](\w+)['\"]", re.MULTILINE)
    return frozenset(
        t for file in models.glob("*/configuration_*.py") for t in declared.findall(file.read_text())
    )


def is_fla_class(cls: type) -> bool:
    return cls.__module__.startswith("fla.")


def transformers_config_class(model_type: str) -> type | None:
    """transformers' own config class for ``model_type`` (whatever FLA or a user registered over it), else None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    module = importlib.import_module(f".{model_type_to_module_name(model_type)}", "transformers.models")
    return getattr(module, CONFIG_MAPPING_NAMES[model_type])


def config_class(model_type: str, impl: str = "auto") -> type:
    """The config class of ``impl``'s choice for ``model_type``: ``fla`` FLA's, ``hf`` transformers' own (or a user's
    registered class), ``auto`` FLA's where FLA has the type, else the one transformers' Auto classes hold."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if impl == "hf":
        own = transformers_config_class(model_type)
        if own is not None:
            return own
        if model_type in CONFIG_MAPPING and not is_fla_class(CONFIG_MAPPING[model_type]):
            return CONFIG_MAPPING[model_type]  # a user's class, registered by an imported module
        elsewhere = " (FLA has one: --model.impl fla)" if model_type in fla_model_types() else ""
        raise ModelConfigError(
            f"--model.impl hf: transformers has no class for model_type '{model_type}'{elsewhere}; "
            "use --model.impl auto"
        )
    if model_type not in CONFIG_MAPPING or model_type in fla_model_types():
        import_fla_models()
    if model_type not in CONFIG_MAPPING:
        raise ModelConfigError(
            f"model_type '{model_type}' is not supported: flame has no family of that name and transformers has "
            "no class registered for it (import the package that registers it with "
            "--experimental.custom_model_path or --experimental.custom_import)"
        )
    cls = CONFIG_MAPPING[model_type]
    if impl == "fla" and not is_fla_class(cls):
        raise ModelConfigError(
            f"--model.impl fla: FLA has no class for model_type '{model_type}' (transformers holds "
            f"{cls.__module__}.{cls.__name__}); use --model.impl auto or hf"
        )
    return cls


# transformers' attention-only decoders, for which --training.varlen keeps packed documents apart: given position_ids
# that restart at each document and no attention mask, transformers' masking_utils (find_packed_sequence_indices)
# makes the causal mask block-diagonal. tests/models/generic/test_varlen.py checks each against its documents run
# alone. Classes with recurrent or convolutional mixers (Qwen3-Next, OLMo-hybrid, LFM2, Mamba) would carry their
# state from one document into the next, so they are not listed.
PACKED_DOCUMENT_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "olmo2", "olmo3", "gemma3_text", "phi3", "granite"}
)


# FLA's classes whose every layer keeps packed documents apart given cu_seqlens, which flame hands to the class's
# forward for its layers (as upstream flame does with --training.varlen). Each is checked against its documents run
# alone: tests/gpu/test_fla_varlen.py on the GPU, and FLA's transformer (its attention on flame's) on the CPU too
# (tests/models/generic/test_varlen.py). ``python scripts/fla_varlen_survey.py`` on a GPU checks every FLA family:
# one whose layer ignores cu_seqlens would mix documents, so a family is listed only once that check passes (H200,
# 2026-12-02: the bfloat16 ones are those whose kernels refuse float32; the verdicts are in docs/models.md).
FLA_PACKED_DOCUMENT_MODEL_TYPES = frozenset(
    {
        "transformer",
        # float32
        "bitnet",
        "comba",
        "cyclic_flow_attention",
        "deltaformer",
        "forgetting_transformer",
        "gated_deltanet",
        "gla",
        "gsa",
        "hgrn",
        "hgrn2",
        "kda",
        "lightnet",
        "linear_attn",
        "log_linear_mamba2",
        "mamba",
        "mamba2",
        "mamba3",
        "mesa_net",
        "mla",
        "moba",
        "mom",
        "nsa",
        "path_attn",
        "precond_gated_deltanet",
        "precond_kda",
        "raven",
        "retnet",
        "rodimus",
        "rwkv6",
        "rwkv7",
        "samba",
        "wall_transformer",
        "yoco",
        # bfloat16
        "delta_net",
        "gated_deltaproduct",
        "parallax",
        "stickbreaking_attn",
    }
)


# transformers' classes whose declared tensor-parallel plan (``base_model_tp_plan``) flame applies
# (flame/parallelize/generic_tensor_parallel.py); tests/parallelize/test_generic_tensor_parallel.py trains each
# with it against one process.
TENSOR_PARALLEL_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "olmo2"})


def config_parallelisms(args: "GenericArgs") -> frozenset[str]:
    """Varlen for transformers' own classes of PACKED_DOCUMENT_MODEL_TYPES and FLA's of
    FLA_PACKED_DOCUMENT_MODEL_TYPES, tensor parallelism for transformers' classes of TENSOR_PARALLEL_MODEL_TYPES
    (users' classes: none)."""
    cls = config_class(args.model_type, args.impl)
    if is_fla_class(cls):
        return frozenset({"varlen"} if args.model_type in FLA_PACKED_DOCUMENT_MODEL_TYPES else ())
    if not cls.__module__.startswith("transformers.models."):
        return frozenset()
    return frozenset(
        name
        for name, types in (("varlen", PACKED_DOCUMENT_MODEL_TYPES), ("tp", TENSOR_PARALLEL_MODEL_TYPES))
        if args.model_type in types
    )


def check_not_composite(hf_config) -> None:
    """A multimodal config (Gemma 3's, Llama 4's, Qwen3.5's) holds its language model in a sub-config, and its own
    vocab_size is none: name the sub-config to train instead of refusing the missing vocab_size."""
    text = hf_config.get_text_config(decoder=True)
    if text is hf_config or getattr(hf_config, "vocab_size", None) is not None:
        return
    raise ModelConfigError(
        f"model_type '{hf_config.model_type}' is a composite (multimodal) config whose language model is its "
        f"{sub_config_key(hf_config, text)} (model_type '{text.model_type}'); flame trains causal language models: "
        f'pass that sub-config as the model config (its keys, with "model_type": "{text.model_type}")'
    )


def sub_config_key(hf_config, sub) -> str:
    return next((key for key, value in vars(hf_config).items() if value is sub), "text_config")


def transformers_alternative(model_type: str, impl: str) -> type | None:
    """transformers' own config class of a model_type whose FLA class ``impl`` auto chose (bitnet, mamba, mamba2):
    the other choice, which --model.impl hf builds."""
    return transformers_config_class(model_type) if impl == "auto" else None


def builds_fla_class(args: "GenericArgs") -> bool:
    """Whether the model is FLA's class (rather than transformers' own or a user's)."""
    return is_fla_class(config_class(args.model_type, args.impl))


def fla_kernels_need_cuda(args: "GenericArgs") -> str | None:
    """FLA's classes run FLA's Triton kernels in every layer (norms, gated MLPs, mixers), with no CPU path: on a
    machine without a GPU Triton finds no driver in the first forward."""
    if builds_fla_class(args):
        own = transformers_alternative(args.model_type, args.impl)
        other = f" (--model.impl hf builds transformers' own {args.model_type} model instead)" if own else ""
        return f"model_type '{args.model_type}' is FLA's class{other}, whose layers run Triton kernels only"
    return None


# FLA's classes whose blocks trace whole under torch.compile: their mixers are flame's (the scans custom ops, FLA's
# layers without mamba_ssm are flame's: FLA_LAYER_REPLACEMENTS; MoBA's op without flash-attn is flame's
# parallel_moba, FlexAttention when compiled) and FLA's norms, activations and rotary embedding run as PyTorch code
# while compiling (FLA_FUNCTIONS_IN_PYTORCH); tests/parallelize/test_compile.py checks that they do. Values: the
# package whose kernels FLA's layer calls where it is installed, which would break the graphs.
FLA_MODEL_TYPES_TRACED_WHOLE = {
    "mamba": "mamba_ssm",
    "mamba2": "mamba_ssm",
    "mamba3": "mamba_ssm",
    "samba": "mamba_ssm",
    "moba": "flash_attn",
}


def fla_blocks_run_eagerly(args: "GenericArgs") -> str | None:
    """FLA's classes call FLA's Triton kernels through autograd functions that dynamo does not trace, so a compiled
    block is several graphs whose guards and wrappers cost the host more than inductor saves, and at the family
    table's sizes the step is bound by the host (docs/performance.md, "FLA classes, compiled and eager"); rwkv7's
    class also fails in inductor (a view of a custom Function modified in place). Those of
    FLA_MODEL_TYPES_TRACED_WHOLE compile, unless the package whose kernels would break their graphs is installed."""
    if not builds_fla_class(args):
        return None
    breaking_package = FLA_MODEL_TYPES_TRACED_WHOLE.get(args.model_type)
    if breaking_package is not None and importlib.util.find_spec(breaking_package) is None:
        return None
    return (
        f"model_type '{args.model_type}' is FLA's class, whose Triton autograd functions split a compiled block "
        "into several graphs that cost more host time than they save"
    )


# FLA 0.6.0 families whose kernels take only some head shapes: the model builds, and the first step stops in a
# Triton compilation error (deltaformer: its kernels tile a head's channels, so the width must be a power of 2 that
# tl.dot takes) or an assertion (path_attn's head widths, NSA's query heads per key/value head). The dry run refuses
# such a config instead: model_type -> the reason a config's shapes are refused, or None.
def _power_of_2_from_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _head_width_refusal(widths: str, takes) -> Callable[[Any], str | None]:
    def refusal(config) -> str | None:
        hidden, heads = config.hidden_size, config.num_heads
        if takes(hidden // heads):
            return None
        return (f"FLA's kernels take heads of {widths} channels, not {hidden // heads} (hidden_size {hidden} / "
                f"num_heads {heads}); choose num_heads so that hidden_size / num_heads is one")  # fmt: skip

    return refusal


def _nsa_group_refusal(config) -> str | None:
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % kv_heads == 0 and _power_of_2_from_16(heads // kv_heads):
        return None
    return (f"NSA's kernels take a power of 2 from 16 query heads per key/value head, not num_heads {heads} / "
            f"num_kv_heads {kv_heads}; choose num_kv_heads so that the ratio is 16, 32, ...")  # fmt: skip


FLA_KERNEL_SHAPES = {
    "deltaformer": _head_width_refusal("a power of 2 from 16 (16, 32, 64, 128)", _power_of_2_from_16),
    "path_attn": _head_width_refusal("16, 32, 64 or 128", lambda width: width in (16, 32, 64, 128)),
    "nsa": _nsa_group_refusal,
}


def check_kernel_shapes(model_type: str, hf_config) -> None:
    refusal = FLA_KERNEL_SHAPES[model_type](hf_config) if model_type in FLA_KERNEL_SHAPES else None
    if refusal:
        raise ModelConfigError(f"model_type '{model_type}': {refusal}")


@dataclass
class GenericArgs(ModelArgs):
    generic: ClassVar[bool] = True

    model_type: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the config JSON, model_type and vocab_size aside
    custom_imports: list[str] = field(default_factory=list)
    impl: str = (
        "auto"  # which class: auto, fla or hf (--model.impl; recorded in flame's configs as flame_impl)
    )

    @classmethod
    def from_dict(cls, config: dict[str, Any], impl: str = "auto") -> tuple["GenericArgs", list[str]]:
        """Args of the config read through ``impl``'s config class, and a notice per key read under a newer name
        (an older FLA release's); ModelConfigError for a key the class would ignore (config_keys.settle_keys)."""
        imports = list(config.get(CUSTOM_IMPORTS_KEY, []))
        custom.import_targets(imports)
        model_type = config["model_type"]
        try:
            config_cls = config_class(model_type, impl)
        except ModelConfigError as e:
            remote = config.get("auto_map")
            if not isinstance(remote, dict) or not remote:
                raise
            raise ModelConfigError(
                f"{e}; its auto_map names remote code ({', '.join(map(str, remote.values()))}), which flame does not "
                "import on its own: register those classes (AutoConfig.register, AutoModelForCausalLM.register) "
                "in a module passed with --experimental.custom_model_path"
            ) from e
        values = {k: v for k, v in config.items() if k not in ("model_type", CUSTOM_IMPORTS_KEY, IMPL_KEY)}
        alternative = transformers_alternative(model_type, impl) if is_fla_class(config_cls) else None
        values, notices = settle_keys(config_cls, model_type, values, alternative)
        try:
            hf_config = config_cls(**values)
        except (TypeError, ValueError, StrictDataclassError) as e:
            # transformers 5's config classes validate their fields' types (huggingface_hub's strict dataclasses)
            raise ModelConfigError(f"{config_cls.__name__} refuses this config: {first_line(e)}") from e
        check_kernel_shapes(model_type, hf_config)
        check_not_composite(hf_config)
        args = cls(
            vocab_size=getattr(hf_config, "vocab_size", None),
            hidden_size=getattr(hf_config, "hidden_size", 0),
            num_hidden_layers=getattr(hf_config, "num_hidden_layers", 0),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # FLA's classes apply it in their own loss, which flame's objective replaces (RWKV7's default: true).
            use_l2warp=bool(getattr(hf_config, "use_l2warp", False)),
            # FLA's key: flame's fused loss from the decoder's output and lm_head (generic/model.py, fuse_lm_head).
            fuse_linear_cross_entropy=bool(getattr(hf_config, "fuse_linear_cross_entropy", False)),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_id=getattr(hf_config, "eos_token_id", None),
            model_type=model_type,
            config={k: v for k, v in values.items() if k != "vocab_size"},
            custom_imports=imports or custom.imports_defining(config_cls),
            impl=impl,
        )
        args.validate()
        return args, notices

    def validate(self) -> None:
        if not isinstance(self.vocab_size, int) or self.vocab_size <= 0:
            raise ModelConfigError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")
        pad = self.config.get("pad_token_id")
        if isinstance(pad, int) and not 0 <= pad < self.vocab_size:
            # the embedding's padding_idx: torch would stop the build with an assertion
            raise ModelConfigError(
                f"pad_token_id {pad} is outside the vocabulary of {self.vocab_size} tokens; set it below vocab_size "
                "or to null"
            )

    def hf_dict(self) -> dict[str, Any]:
        """The model's config as transformers reads it (the config JSON with this run's vocab_size)."""
        return {**self.config, "model_type": self.model_type, "vocab_size": self.vocab_size}

    def hf_config(self):
        values = self.hf_dict()
        del values["model_type"]
        return config_class(self.model_type, self.impl)(**values)

    def to_dict(self) -> dict[str, Any]:
        record = {CUSTOM_IMPORTS_KEY: self.custom_imports} if self.custom_imports else {}
        if self.impl != "auto":
            record[IMPL_KEY] = self.impl
        return {**self.hf_dict(), **record}

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameter count and training FLOPs per token counted from the model's modules
        (flame.models.common.module_flops): matmul weights, convolutions and the sequence mixers' own terms."""
        nparams = sum(p.numel() for p in model.parameters())
        blocks = [block for name in model.flame_blocks for block in model.get_submodule(name)]
        count = module_flops(model, blocks, seq_len)
        if count.uncounted:
            logger.warning(
                f"FLOPs per token count only the weights of these layers, not their own sequence-mixing terms "
                f"(MFU reads low): {', '.join(count.uncounted)}"
            )
        return nparams, count.total
