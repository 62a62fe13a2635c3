"""torch.compile per block."""

import torch
from torch import nn
from torchtitan.tools.logging import logger


def compile_blocks(model: nn.Module, backend: str) -> None:
    """Compile each block separately: repeated structure compiles once, and FSDP hooks stay outside the graphs
    (pytorch#181924: FSDP2 hooks break fullgraph graphs). fullgraph is off because FLA's ops are
    ``torch.compiler.disable``d and graph-break."""
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block, backend=backend, fullgraph=False))
    logger.info("Compiled each block with torch.compile (backend %s)", backend)
