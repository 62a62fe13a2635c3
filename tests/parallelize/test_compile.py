"""flame.parallelize.compile on the CPU (dynamo with the eager backend: what is traced and how often)."""

import torch
from torch import nn

from flame.parallelize import compile as compile_module


class LayerBranchingBlock(nn.Module):
    """A block whose code branches on its layer's index, as FLA's HGRN does on ``layer_idx > 0``."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return x * 2 if self.layer_idx > 0 else x


def test_every_block_is_compiled_past_dynamos_recompile_limit(monkeypatch):
    """Twelve blocks that each specialise on their index: each is a graph of its own, none left to run eagerly
    (dynamo's default limit, 8, would leave the last four uncompiled)."""
    from torch._dynamo.utils import counters

    model = nn.Module()
    model.layers = nn.ModuleList(LayerBranchingBlock(i) for i in range(12))
    model.args = None
    spec = type("Spec", (), {"blocks": staticmethod(lambda m: [m.layers])})()
    monkeypatch.setattr(compile_module, "model_spec", lambda args: spec)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    torch._dynamo.reset()
    counters.clear()
    compile_module.compile_blocks(model, backend="eager")
    x = torch.randn(3, 4)
    for block in model.layers:
        x = block(x)
    assert counters["stats"]["unique_graphs"] == 12
    torch._dynamo.reset()
