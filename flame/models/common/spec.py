"""What a model family registers (one entry per family, the contract parallelize, the dry run and export read).

- ``args_cls``: the family's :class:`ModelArgs`, read from a config JSON (``from_dict``); its
  ``get_nparams_and_flops`` is the family's parameter count and training FLOPs per token.
- ``model_cls``: called with the args (on the meta device) to build the model; the model has ``args``,
  ``init_weights()`` and ``forward(input_ids, position_ids=, cu_seqlens=) -> logits``. flame's families give
  ``built_by(module, name)``, which imports the model's module at the first build: the spec and the args import no
  torch, so train.sh's pre-flight checks a config without it.
- ``blocks``: the modules whose children are the model's blocks, the unit of FSDP, activation checkpointing and
  torch.compile (flame's families keep them in ``layers``; others elsewhere, or in several stacks).
- ``parallelisms``: what the family supports beyond data parallelism (FSDP/HSDP/DDP work for every family):
  any of :data:`MODEL_PARALLELISMS`; the others are refused before launch.
- ``config_parallelisms``: those that only some models of the family support, read from the model's args (the
  generic family: varlen for the transformers classes that keep packed documents apart).
- ``needs_cuda``: for models that cannot run without a CUDA GPU, why (read from the model's args; the generic
  family: FLA's classes, whose layers run Triton kernels only); None where the model also trains on the CPU.
- ``eager_blocks``: for models whose blocks ``--compile.enable`` leaves eager, why (measured slower compiled than
  eager: the generic family's FLA classes); None where the blocks are compiled.
- ``block_graph_call``: for families whose compiled blocks replay as CUDA graphs (``--compile.graph_compiled_blocks``),
  whether a block call's integer tensors are read on the GPU only, so that they are graph inputs like its other
  tensors; None where compiled blocks do not replay (the generic family: its classes' masks steer kernels from the
  host).
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flame.models.common.args import ModelArgs

if TYPE_CHECKING:  # a family's spec imports no torch: train.sh's pre-flight checks a config without it
    from torch import nn

# Flag and name of each parallelism a family may declare.
MODEL_PARALLELISMS = {
    "tp": "tensor parallelism (--parallelism.tensor_parallel_degree)",
    "pp": "pipeline parallelism (--parallelism.pipeline_parallel_degree)",
    "cp": "context parallelism (--parallelism.context_parallel_degree)",
    "varlen": "packed documents without attention across them (--training.varlen)",
}


def built_by(module: str, name: str) -> Callable[[ModelArgs], "nn.Module"]:
    """A ``model_cls`` that imports ``module`` (the model's layers, torch) when it first builds a model: a family's
    spec is read without them, so train.sh's pre-flight checks a config without importing torch."""

    def build(args: ModelArgs) -> "nn.Module":
        return getattr(importlib.import_module(module), name)(args)

    build.__qualname__ = f"built_by({module}.{name})"
    return build


def decoder_blocks(model: "nn.Module") -> list["nn.Module"]:
    """flame's DecoderLM keeps its blocks in ``layers``."""
    return [model.layers]


def decoder_block_graph_call(args: tuple, kwargs: dict) -> bool:
    """flame's DecoderLM calls a block as ``block(h, position_ids, cu_seqlens)``: the positions are read on the GPU
    only, while packed documents' boundaries size kernel launches on the host (a replay would keep the first batch's)."""
    cu_seqlens = args[2] if len(args) > 2 else kwargs.get("cu_seqlens")
    return cu_seqlens is None


@dataclass(frozen=True)
class ModelSpec:
    args_cls: type[ModelArgs]
    model_cls: Callable[[ModelArgs], "nn.Module"]
    blocks: Callable[["nn.Module"], list["nn.Module"]] = decoder_blocks
    parallelisms: frozenset[str] = frozenset(MODEL_PARALLELISMS)
    config_parallelisms: Callable[[ModelArgs], frozenset[str]] | None = None
    needs_cuda: Callable[[ModelArgs], str | None] | None = None
    eager_blocks: Callable[[ModelArgs], str | None] | None = None
    block_graph_call: Callable[[tuple, dict], bool] | None = decoder_block_graph_call

    def cuda_reason(self, args: ModelArgs) -> str | None:
        """Why a model of these args needs a CUDA GPU, or None when it also runs on the CPU."""
        return self.needs_cuda(args) if self.needs_cuda else None

    def eager_reason(self, args: ModelArgs) -> str | None:
        """Why --compile.enable leaves a model of these args' blocks eager, or None where it compiles them."""
        return self.eager_blocks(args) if self.eager_blocks else None

    def supported(self, args: ModelArgs) -> frozenset[str]:
        """What a model of these args supports beyond data parallelism."""
        extra = self.config_parallelisms(args) if self.config_parallelisms else frozenset()
        return self.parallelisms | extra
