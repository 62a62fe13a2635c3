"""flame's kernels as torch custom ops inside compiled graphs and as autograd.Functions in eager calls.

A torch.library custom op is one node of a compiled graph: inductor neither traces into it nor breaks the graph
around it. An eager call through the op pays the dispatcher and the op's Python autograd layer on the host: on an
H100's host 0.09-0.13 ms more per forward + backward of the softpick kernel (whose kernels take 0.66-0.71 ms at
T = 1024) and 0.06 ms more for the short convolution (docs/performance.md, "Softpick attention kernel").
`differentiable_op` registers one implementation both ways and picks per call.
"""

from collections.abc import Callable

import torch


def differentiable_op(
    op: torch.library.CustomOpDef, forward: Callable, setup_context: Callable, backward: Callable
) -> Callable:
    """Registers ``backward`` and ``setup_context`` (as for ``op.register_autograd``) as ``op``'s autograd, and
    returns the callable the op's users call with the op's positional arguments: ``op`` while torch.compile traces,
    else an autograd.Function that runs ``forward`` (the op's implementation) with the same ``setup_context`` and
    ``backward``."""
    op.register_autograd(backward, setup_context=setup_context)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    def call(*inputs):
        return op(*inputs) if torch.compiler.is_compiling() else Eager.apply(*inputs)

    return call
