"""flame.models.layers.rotary: the cos/sin tables as a custom op under torch.compile, the same values as eager."""

import torch

from flame.models.layers.rotary import apply_rotary, rotary_cos_sin, rotary_cos_sin_op


def test_the_table_op_passes_opcheck():
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])  # packed documents restart at 0
    torch.library.opcheck(rotary_cos_sin_op, (positions, 8, 10000.0))


def test_compiled_rotation_reads_the_op_and_equals_eager():
    """Under compile the tables come from the op (one node the rotation reads); q and k rotate as in eager, to the
    last bit on a CPU (the same float32 ops)."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 13, 3, 8, generator=generator) for _ in range(2))
    positions = torch.arange(13).repeat(2, 1)

    def rotate(q, k, positions):
        cos, sin = rotary_cos_sin(positions, 8, 500000.0)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(rotate, backend=backend, fullgraph=True)
    for got, want in zip(compiled(q, k, positions), rotate(q, k, positions), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (graph,) = graphs
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.flame.rotary_cos_sin.default) == 1
    assert torch.cos not in targets and torch.sin not in targets
