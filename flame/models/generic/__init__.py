"""The generic family: any model_type flame does not implement itself, built from the causal-LM class that
transformers' Auto classes hold for it (transformers' own models, FLA's after ``import fla``, a user's registered
class). Trains data-parallel (FSDP/HSDP/DDP), with varlen for transformers' attention-only decoders and tensor
parallelism (the class's declared plan, on its blocks) for a verified few of them; pipeline and context parallelism
need flame's own families. FLA's classes' blocks stay eager under --compile.enable (fla_blocks_run_eagerly)."""

from flame.models.common.spec import ModelSpec
from flame.models.generic.args import (
    GenericArgs,
    config_parallelisms,
    fla_blocks_run_eagerly,
    fla_kernels_need_cuda,
)
from flame.models.generic.model import build_generic_model, generic_blocks

SPEC = ModelSpec(
    args_cls=GenericArgs,
    model_cls=build_generic_model,
    blocks=generic_blocks,
    parallelisms=frozenset(),
    config_parallelisms=config_parallelisms,
    needs_cuda=fla_kernels_need_cuda,
    eager_blocks=fla_blocks_run_eagerly,
    block_graph_call=None,
)
