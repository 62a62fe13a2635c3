"""A generic-family model: the registered causal-LM class itself (its parameter names, its ``_init_weights``),
with flame's calling convention mixed in front of it."""

import contextlib
import functools
import importlib.util
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from flame.compat import (
    fla_attention_delta_on_flame,
    fla_deltaformer_on_flame,
    fla_flash_attn_calls_on_flame,
    fla_functions_traced_under_compile,
    fla_layers_on_flame,
    fla_linear_attn_hands_layers_cu_seqlens,
    fla_log_linear_masks_built_once,
    fla_log_linear_scales_in_the_inputs_dtype,
    fla_moba_on_flame,
    fla_ops_opaque_to_compile,
    fla_rodimus_blocks_follow_the_model,
    fla_rotary_tables_traced_under_compile,
    fla_tilelang_attention_takes_what_it_compiles,
    transformers_gated_delta_rule_on_flame,
    transformers_grouped_mm_in_the_autocast_dtype,
)
from flame.errors import ModelConfigError, first_line
from flame.models.common.decoder import LMHead
from flame.models.generic.args import GenericArgs, is_fla_class
from flame.models.generic.initialization import check_initialized, initialize_as_constructed
from flame.models.layers.fla_attention import deltaformer_attention, flash_attn_func, flash_attn_varlen_func
from flame.models.layers.fla_moba import parallel_moba
from flame.ops import activations, rotary
from flame.ops.attention_delta import attention_delta
from flame.ops.norm import group_rms_norm_gated_torch, residual_rms_norm_torch

logger = logging.getLogger(__name__)

# FLA's layers that flame builds in their place (same parameters) while their fast path does not import: FLA's
# softmax attention without flash-attn, Mamba, Mamba2 and Mamba3 (SISO) without mamba_ssm; and always LogLinearMamba2,
# whose own layer mixes packed documents. Values: flame's class, the attribute of FLA's layer module that holds the
# fast path, None for always (flame.compat.fla_layers_on_flame).
FLA_LAYER_REPLACEMENTS = {
    "fla.layers.attn.Attention": ("flame.models.layers.fla_attention.FLAAttention", "flash_attn_func"),
    "fla.layers.bitattn.BitAttention": (
        "flame.models.layers.fla_attention.FLABitAttention",
        "flash_attn_func",
    ),
    "fla.layers.mamba.Mamba": ("flame.models.layers.fla_mamba.FLAMamba", "is_fast_path_available"),
    "fla.layers.mamba2.Mamba2": ("flame.models.layers.fla_mamba2.FLAMamba2", "is_fast_path_available"),
    "fla.layers.mamba3.Mamba3": ("flame.models.layers.fla_mamba3.FLAMamba3", "is_fast_path_available"),
    "fla.layers.log_linear_mamba2.LogLinearMamba2": (
        "flame.models.layers.fla_log_linear_mamba2.FLALogLinearMamba2",
        None,
    ),
}

# FLA's functions that compiled blocks run as PyTorch code (flame.compat.fla_functions_traced_under_compile).
FLA_FUNCTIONS_IN_PYTORCH = {
    "fla.modules.norm.layernorm.rms_norm": residual_rms_norm_torch,
    "fla.modules.norm.layernorm_gated.rmsnorm_fn": group_rms_norm_gated_torch,
    "fla.modules.activations.ops.swish": activations.swish,
    "fla.modules.activations.ops.swiglu": activations.swiglu,
    "fla.modules.activations.ops.swiglu_linear": activations.swiglu_linear,
    "fla.modules.rotary.ops.rotary_embedding": rotary.rotary_embedding,
}


class FlameCausalLM:
    """Mixed in front of a transformers causal-LM class: ``forward`` returns the logits of every position (flame's
    data holds the labels already shifted, and flame's loss reads the logits, so the class never sees labels), and
    keeps in ``auxiliary_loss`` what the class's own loss would add to the cross-entropy (``class_auxiliary_loss``;
    None without), which the training step adds to flame's.
    The trainer's ``init_weights()`` after ``to_empty`` gives the values ``from_config`` gives on a real device: the
    constructor's own (``initialization.py``), then transformers' ``init_weights`` (the class's ``_init_weights``
    over every module its constructor did not mark initialised, then the ties as the class declares). The class's
    post_init calls ``init_weights`` too, inside the constructor: transformers' own there (on the meta device it
    only ties)."""

    def __init__(self, config, *args, **kwargs):
        self.flame_constructed = False
        super().__init__(config, *args, **kwargs)
        self.flame_constructed = True

    # transformers decides whether a class may choose its attention and experts kernels by reading the source of
    # ``cls.__module__``, which for flame's class is this module: the wrapped class answers instead, so that a
    # mixture-of-experts class (qwen3_next, ...) keeps grouped_mm rather than its per-expert loop.
    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return cls.flame_lm_class._can_set_attn_implementation()

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return cls.flame_lm_class._can_set_experts_implementation()

    def built_again(self) -> nn.Module:
        """The model built from its config again, as build_generic_model built it (FLA's attention included)."""
        return instantiate(self.flame_lm_class, self.config)

    def init_weights(self) -> None:
        if not self.flame_constructed:
            return super().init_weights()
        left = initialize_as_constructed(self)
        super().init_weights()
        check_initialized(self, left)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens=None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        # With --training.varlen, position_ids restarting at each document are what keeps the documents apart in
        # transformers' classes (PACKED_DOCUMENT_MODEL_TYPES); FLA's hand cu_seqlens to their layers
        # (FLA_PACKED_DOCUMENT_MODEL_TYPES).
        documents = {} if position_ids is None else {"position_ids": position_ids}
        if cu_seqlens is not None and is_fla_class(self.flame_lm_class):
            documents["cu_seqlens"] = cu_seqlens
        if return_hidden:
            # fuse_linear_cross_entropy: what the class applies lm_head to, its decoder's output.
            output = self.base_model(input_ids=input_ids, **documents)
            self.auxiliary_loss = class_auxiliary_loss(self, output)
            return output[0]
        output = super().forward(input_ids=input_ids, **documents)
        self.auxiliary_loss = class_auxiliary_loss(self, output)
        return output.logits


def class_auxiliary_loss(model: nn.Module, output) -> torch.Tensor | None:
    """The term beside the cross-entropy that the class adds to its loss, which flame's objective replaces: the
    router load balancing of transformers' mixture-of-experts classes (router_aux_loss_coef x aux_loss, computed
    where the config's output_router_logits is true) and of FLA's MoM (aux_loss_scale x its load balancing, always:
    fla/models/mom/modeling_mom.py adds it whenever it has labels)."""
    aux = getattr(output, "aux_loss", None)
    if aux is not None and hasattr(model, "router_aux_loss_coef"):
        return model.router_aux_loss_coef * aux
    if is_fla_class(model.flame_lm_class) and model.config.model_type == "mom":
        from fla.models.mom.modeling_mom import load_balancing_loss_func

        aux = load_balancing_loss_func(output.router_logits, model.num_memories, model.topk)
        return model.aux_loss_scale * aux if isinstance(aux, torch.Tensor) else None
    return None


@functools.cache
def flame_class(causal_lm_class: type) -> type:
    return type(
        causal_lm_class.__name__,
        (FlameCausalLM, causal_lm_class),
        {"__module__": __name__, "__qualname__": causal_lm_class.__name__, "flame_lm_class": causal_lm_class},
    )


def causal_lm_class(config) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ModelConfigError(
            f"transformers has a config class for model_type '{config.model_type}' but no causal LM class; "
            "register one with AutoModelForCausalLM.register(YourConfig, YourForCausalLM)"
        ) from None


def find_blocks(model: nn.Module) -> list[str]:
    """Names of the ModuleLists holding the model's blocks: those whose modules are all of the class's
    ``_no_split_modules`` (transformers' declaration of its decoder layers; some models have several stacks),
    else the only ModuleList with num_hidden_layers modules, else the only one of several modules of one class
    (Blenderbot's causal LM declares none, and its num_hidden_layers counts the encoder's layers)."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    found = [name for name, m in lists if all(type(block).__name__ in block_names for block in m)]
    if not found:
        layers = getattr(model.config, "num_hidden_layers", None)
        found = [name for name, m in lists if len(m) == layers]
        if not found:
            stacks = [name for name, m in lists if len(m) > 1 and len({type(block) for block in m}) == 1]
            found = stacks if len(stacks) == 1 else []
        if len(found) > 1:
            raise ModelConfigError(
                f"cannot tell which ModuleList of {type(model).__name__} holds its blocks ({', '.join(found)}); "
                "declare the block class on the model: _no_split_modules = ['YourDecoderLayer']"
            )
    if not found:
        raise ModelConfigError(
            f"{type(model).__name__} has no ModuleList of blocks (the unit of FSDP, activation checkpointing and "
            "compile): keep the decoder layers in an nn.ModuleList and declare their class with "
            "_no_split_modules = ['YourDecoderLayer']"
        )
    return found


def refusing_layer(error: ImportError) -> str:
    """The class of the innermost FLA layer whose constructor raised ``error`` (the frame's ``self``)."""
    name = "an attention layer"
    frame = error.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        if owner is not None and type(owner).__module__.startswith("fla.layers"):
            name = f"{type(owner).__module__}.{type(owner).__name__}"
        frame = frame.tb_next
    return name


@contextlib.contextmanager
def fla_classes_as_flame_builds_them() -> Iterator[None]:
    """FLA's modules with flame's fixes for the process (flame.compat: flash-attn's calls and DeltaFormer's and
    MoBA's ops on flame's attention, rodimus' residual flag, linear attention's packed documents reaching its layers, log-linear attention's scales and masks, the head
    widths FLA's TileLang attention takes, the attention backward's delta on flame's kernel, FLA's ops called rather
    than traced by torch.compile) and, while open, FLA's layers that would need flash-attn or mamba_ssm
    built as flame's (FLA_LAYER_REPLACEMENTS, the same parameters): FLA's classes built inside it are what flame
    trains, so the bench's naive loop and the export check build FLA's own class the same way."""
    fla_deltaformer_on_flame(deltaformer_attention)
    fla_moba_on_flame(parallel_moba)
    fla_rodimus_blocks_follow_the_model()
    fla_linear_attn_hands_layers_cu_seqlens()
    fla_log_linear_scales_in_the_inputs_dtype()
    fla_log_linear_masks_built_once()
    fla_tilelang_attention_takes_what_it_compiles()
    fla_attention_delta_on_flame(attention_delta)
    fla_functions_traced_under_compile(FLA_FUNCTIONS_IN_PYTORCH)
    fla_ops_opaque_to_compile()
    fla_rotary_tables_traced_under_compile()
    fla_flash_attn_calls_on_flame(
        {"flash_attn_func": flash_attn_func, "flash_attn_varlen_func": flash_attn_varlen_func}
    )
    with fla_layers_on_flame(FLA_LAYER_REPLACEMENTS):
        yield


def instantiate(lm_class: type, config) -> nn.Module:
    """flame's class over ``lm_class``, built; FLA's classes build their flash-attn attention layers and Mamba2 as
    flame's (FLA_LAYER_REPLACEMENTS) where flash-attn or mamba_ssm is not importable, and a flash-attn layer flame has
    no replacement for stops with one line naming it."""
    cls = flame_class(lm_class)
    if not is_fla_class(lm_class):
        transformers_gated_delta_rule_on_flame(transformers_chunk_gated_delta_rule)
        transformers_grouped_mm_in_the_autocast_dtype()
        with refused_by_the_class(lm_class):
            return cls(config)
    try:
        with fla_classes_as_flame_builds_them(), refused_by_the_class(lm_class):
            model = cls(config)
    except ImportError as e:
        if "flash" not in str(e).lower():
            raise
        raise ModelConfigError(
            f"model_type '{config.model_type}' needs flash-attn, which is not installed: FLA's {refusing_layer(e)} "
            "runs only on it (flame runs FLA's Attention and BitAttention on its own attention, not this layer); "
            "install flash-attn or choose another model_type"
        ) from e
    report_replaced_layers(model)
    return model


@contextlib.contextmanager
def refused_by_the_class(lm_class: type) -> Iterator[None]:
    """A value error of the model's own constructor (transformers' or FLA's code, which builds some classes' default
    configs into models that cannot be built: Nemotron's num_key_value_heads null) as one line naming the class and
    where it failed, rather than a traceback; an error raised in flame's code passes through."""
    try:
        yield
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        last = traceback.extract_tb(e.__traceback__)[-1]
        where = library_path(last.filename)
        if where is None or isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(
            f"{lm_class.__name__} cannot be built from this config: {type(e).__name__}: {first_line(e)} "
            f"({where}:{last.lineno}); a key the class needs is missing or null there, so set it in the config"
        ) from e


def library_path(filename: str) -> str | None:
    """``filename`` as a path inside the transformers or FLA package (``transformers/models/...``), or None."""
    for package in ("transformers", "fla"):
        spec = importlib.util.find_spec(package)
        root = Path(spec.origin).parent if spec and spec.origin else None
        if root is not None and Path(filename).is_relative_to(root):
            return str(Path(package) / Path(filename).relative_to(root))
    return None


def report_replaced_layers(model: nn.Module) -> None:
    """One log line naming FLA's layers that flame built as its own (FLA_LAYER_REPLACEMENTS): FLA's constructors warn
    that their fast path is missing (and Mamba3's that MIMO is unavailable), which flame's layers do not need."""
    flame_classes = {
        path: fla_name.rsplit(".", 1)[-1] for fla_name, (path, _) in FLA_LAYER_REPLACEMENTS.items()
    }
    replaced = {
        type(module).__name__: flame_classes[path]
        for module in model.modules()
        if (path := f"{type(module).__module__}.{type(module).__name__}") in flame_classes
    }
    if replaced:
        names = ", ".join(f"{theirs} as {ours}" for ours, theirs in sorted(replaced.items()))
        logger.info(
            "FLA's layers run as flame's, with the same parameters: %s; FLA's warnings that flash-attn or "
            "mamba_ssm is missing do not apply to them",
            names,
        )


def transformers_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **unused,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``torch_chunk_gated_delta_rule`` call (its Gated DeltaNet layers') on flame's op, which has FLA's
    semantics: ``chunk_size`` (FLA's kernels chunk by 64) and the other keyword arguments a layer passes on are
    dropped, as transformers' hook drops them for FLA's op (flame.compat.transformers_gated_delta_rule_on_flame)."""
    from flame.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def build_generic_model(args: GenericArgs) -> nn.Module:
    config = args.hf_config()
    config.use_cache = False  # training: no key/value cache
    model = instantiate(causal_lm_class(config), config)
    model.args = args
    model.flame_blocks = find_blocks(model)
    if args.fuse_linear_cross_entropy:
        fuse_lm_head(model)
    return model


def fuse_lm_head(model: nn.Module) -> None:
    """``fuse_linear_cross_entropy`` (FLA's key; FLA's classes compute logits = lm_head(decoder output)): the class's
    lm_head becomes flame's LMHead, whose call with labels computes the loss chunk by chunk without the batch's
    logits (flame/ops/linear_cross_entropy.py). The module keeps its weight, its ties and its place in the model;
    only its forward gains that call."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        raise ModelConfigError(
            f"fuse_linear_cross_entropy needs an lm_head that is a bias-free nn.Linear, and "
            f"{type(model).__name__}'s is {head}; set fuse_linear_cross_entropy false in the model config"
        )
    head.__class__ = LMHead


def generic_blocks(model: nn.Module) -> list[nn.Module]:
    return [model.get_submodule(name) for name in model.flame_blocks]
