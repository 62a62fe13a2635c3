"""flame.ops.custom_ops: one implementation as a custom op in compiled graphs and an autograd.Function in eager."""

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from flame.ops.custom_ops import differentiable_op


def _scaled_square(x: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return x.square() * scale, x.sum()


scaled_square_fwd = torch.library.custom_op("flame_test::scaled_square_fwd", _scaled_square, mutates_args=())


@scaled_square_fwd.register_fake
def _(x, scale):
    return torch.empty_like(x), x.new_empty(())


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dy, _dtotal):
    (x,) = ctx.saved_tensors
    return 2 * ctx.scale * x * dy, None


scaled_square = differentiable_op(scaled_square_fwd, _scaled_square, _setup_context, _backward)


class DispatchedOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_eager_calls_run_the_implementation_without_the_ops_dispatch():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with DispatchedOps() as ops:
        y, total = scaled_square(x, 1.5)
        y.sum().backward()
    assert not any(name.startswith("flame_test") for name in ops.names)
    torch.testing.assert_close(y, 1.5 * x.detach().square(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, 3 * x.detach(), rtol=0, atol=0)
    assert not total.requires_grad  # setup_context's mark_non_differentiable holds in eager too


def test_compiled_graphs_hold_the_op_and_match_eager():
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    targets = []

    def record(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes)
        return graph_module.forward

    def loss(x):
        return scaled_square(x * 2, 0.25)[0].sum()

    compiled = torch.compile(loss, backend=record, fullgraph=True)
    eager_grad = torch.autograd.grad(loss(x), x)[0]
    compiled_grad = torch.autograd.grad(compiled(x), x)[0]
    assert "flame_test.scaled_square_fwd.default" in targets
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=0, atol=0)
    # The op's own autograd (compiled graphs, direct calls) is the registered backward.
    direct = torch.autograd.grad(scaled_square_fwd(x, 0.25)[0].sum(), x)[0]
    torch.testing.assert_close(direct, 0.5 * x.detach(), rtol=0, atol=0)
