"""torch.compile per block, and of the loss (torchtitan's ``compile.components``: "model", "loss")."""

from collections.abc import Callable

import torch
from torch import nn
from torchtitan.tools.logging import logger

from flame.models import model_spec
from flame.parallelize.checks import CUDA_GRAPH_MODES
from flame.parallelize.cuda_graphs import graph_blocks


def compile_options(backend: str, mode: str = "default") -> dict:
    """torch.compile's keyword arguments for flame's compiled regions: inductor's mode only where it applies."""
    return {"backend": backend, **({"mode": mode} if mode != "default" else {})}


def graphs_can_replay_blocks(job_config, world_size: int, on_gpu: bool) -> bool:
    """Whether a run's blocks can replay as CUDA graphs: on one GPU, where nothing runs between the blocks (no
    data-parallel hooks or collectives, no activation checkpointing or offloading)."""
    return (
        on_gpu
        and world_size == 1
        and job_config.activation_checkpoint.mode == "none"
        and job_config.activation_offload.mode != "full"
    )


def graphs_eager_blocks(job_config, world_size: int, on_gpu: bool) -> bool:
    """Whether blocks that torch.compile leaves eager replay as CUDA graphs."""
    return job_config.compile.graph_eager_blocks and graphs_can_replay_blocks(job_config, world_size, on_gpu)


def graphs_compiled_blocks(job_config, world_size: int, on_gpu: bool) -> bool:
    """Whether compiled blocks replay as CUDA graphs: not where inductor's own graphs replay them (the CUDA graph
    modes) nor with packed documents, whose every call the graphs would leave to the compiled blocks."""
    return (
        job_config.compile.graph_compiled_blocks
        and job_config.compile.mode not in CUDA_GRAPH_MODES
        and not job_config.training.varlen
        and graphs_can_replay_blocks(job_config, world_size, on_gpu)
    )


def compile_blocks(
    model: nn.Module,
    backend: str,
    mode: str = "default",
    graph_eager_blocks: bool = False,
    compile_graphed_blocks: bool = True,
    graph_compiled_blocks: bool = False,
) -> None:
    """Compile each block separately: repeated structure compiles once, and FSDP hooks stay outside the graphs
    (pytorch#181924: FSDP2 hooks break fullgraph graphs). Under compile the gated and the plain chunk delta rule and
    the short conv (flame's kernel) run as torch.library custom ops and the norms as PyTorch code (flame.ops), so a
    Gated DeltaNet, DeltaNet or attention block is one graph; fullgraph stays off because FLA's fused recurrent delta
    rule (DeltaNet's sequences of at most 64 tokens) and its context parallelism still break the graph. A family may
    leave its blocks eager where compiling them was measured to be slower (``ModelSpec.eager_blocks``): one log line
    says why; with ``graph_eager_blocks`` (one GPU, no activation checkpointing or offloading) they replay as CUDA
    graphs instead (flame.parallelize.cuda_graphs), of the blocks compiled where ``compile_graphed_blocks``. With
    ``graph_compiled_blocks`` a family's compiled blocks replay as CUDA graphs too, where its spec says which calls
    can (``ModelSpec.block_graph_call``); the calls the graphs do not serve run the compiled blocks."""
    spec = model_spec(model.args)
    reason = spec.eager_reason(model.args)
    stacks = spec.blocks(model)
    # Blocks whose code branches on a per-layer constant (a layer index, transformers' hybrids' layer types) compile
    # once per value; past dynamo's recompile limit (8) the later blocks would run eagerly without a word.
    blocks = sum(len(stack) for stack in stacks)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, blocks)
    if reason is not None:
        if graph_eager_blocks:
            # Compiled inside the graphs: the guards' host time is spent only while capturing.
            options = compile_options(backend, CUDA_GRAPH_MODES.get(mode, mode))
            graph_blocks(stacks, options if compile_graphed_blocks else None)
            logger.info(
                "torch.compile leaves the blocks eager and they replay as CUDA graphs of the %s blocks, captured "
                "beside the first training step: %s",
                "compiled" if compile_graphed_blocks else "eager",
                reason,
            )
        else:
            logger.info("torch.compile leaves the blocks eager: %s", reason)
        return
    if graph_compiled_blocks and spec.block_graph_call is not None:
        graph_blocks(stacks, compile_options(backend, mode), spec.block_graph_call, compiled_unserved=True)
        logger.info(
            "Compiled each block with torch.compile (backend %s, mode %s); the compiled blocks replay as CUDA "
            "graphs, captured beside the first training step",
            backend,
            mode,
        )
        return
    for stack in stacks:
        for layer_id, block in stack.named_children():
            stack.register_module(
                layer_id, torch.compile(block, fullgraph=False, **compile_options(backend, mode))
            )
    logger.info("Compiled each block with torch.compile (backend %s, mode %s)", backend, mode)


def graph_break_report() -> str | None:
    """One line saying where torch.compile has broken the compiled regions' graphs in this process (dynamo counts each
    break once, when it traces the region), or None where it has not: each break is a return to Python at every call
    of the region, host time that a step bound by its host pays in full (docs/performance.md, "Compiled blocks stay
    one graph where a backend refuses a call")."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    if not breaks:
        return None
    shown = 3
    reasons = "; ".join(
        " ".join(line.strip() for line in reason.splitlines()[:2] if line.strip())[:240]
        for reason in list(breaks)[:shown]
    )
    more = f"; and {len(breaks) - shown} other reasons" if len(breaks) > shown else ""
    return (
        f"torch.compile broke the compiled graphs at {sum(breaks.values())} places, each a return to Python at every "
        f"call: {reasons}{more}"
    )


def maybe_compile_loss(loss_fn: Callable, compile_config) -> Callable:
    """The loss compiled when ``compile.components`` has "loss": the float32 upcast of the logits, the
    log-softmax and the gather fuse into a pass over the bf16 logits instead of several over float32 copies."""
    if not (compile_config.enable and "loss" in compile_config.components):
        return loss_fn
    # Without CUDA graphs: a graph's outputs live in memory its next replay overwrites, and the step keeps each
    # micro-batch's loss sums until all of them have run.
    backend, mode = compile_config.backend, CUDA_GRAPH_MODES.get(compile_config.mode, compile_config.mode)
    logger.info("Compiled the loss with torch.compile (backend %s, mode %s)", backend, mode)
    return torch.compile(loss_fn, **compile_options(backend, mode))
