"""Blocks that run eagerly replayed as CUDA graphs: the host issues a block's forward or backward as one graph
launch instead of its dozens of kernels, for the models whose blocks torch.compile leaves eager (FLA's classes,
``ModelSpec.eager_blocks``), whose small steps are bound by the host's kernel launches (docs/performance.md, "FLA
classes, compiled and eager").

The idea is torch.cuda.make_graphed_callables': warm every block up, capture each block's forward in order and each
backward in reverse into one memory pool (the order the training step replays them in, so a replay never
overwrites memory a later one still reads), and replay them from an autograd Function. flame captures its own so
that one block's output buffer is the next block's input buffer and its input-gradient buffer the previous block's
output-gradient buffer (nothing is copied between blocks), and so that a call unlike the captured one (another
shape, evaluation, no grad, packed documents' tensors) runs the block's own forward.

A step's first micro-batch replays; the later ones run eagerly. The backward graphs' parameter gradients live in
the pool, autograd adopts them as ``.grad``, and a later micro-batch's forward replay would overwrite them before
the optimizer reads them (which torch's make_graphed_callables leaves to its caller: two micro-batches gave gradient
norms of 843 against the eager blocks' 5.9 on an H200).

One GPU only (a data-parallel or sharded step's hooks and collectives sit between the blocks), without activation
checkpointing or offloading (they re-run or move what the forward graph keeps in its pool).
"""

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torchtitan.tools.logging import logger

WARMUP_ITERATIONS = 2  # Triton's compilation and autotuning, cuBLAS's workspaces: all before the capture


class BlockGraphs:
    """The blocks of one stack (called in order, each on the previous one's first output), replayed as CUDA
    graphs from the first training call of the first block that the graphs can serve.

    A call is served when it is a training call (module in training mode, grad enabled) on CUDA whose only tensor is
    the hidden states (first positional argument) and whose other arguments, the hidden states' shape, dtype and
    ``requires_grad`` and the autocast state equal the captured call's, and when no parameter holds a gradient yet
    (a step's first micro-batch) and the last replayed forward's backward has run. Every other call runs the
    block's own forward, as does every call after a capture that failed (one log line says why)."""

    def __init__(self, blocks: list[nn.Module]):
        self.blocks = blocks
        self.eager_forwards = [block.forward for block in blocks]
        self.graphs: list[_BlockGraph] = []  # empty before the capture
        self.failed = False
        # The forward being run replays the graphs (decided at its first block); a replayed forward's backward has
        # not run yet (another forward's replay would overwrite what that backward reads: it runs eagerly).
        self.replaying = False
        self.backward_pending = False
        self.warned_eager = False
        for index, block in enumerate(blocks):
            # An instance attribute: nn.Module.__call__ finds it, and the parameters' names stay as they are.
            block.forward = functools.partial(self.call, index)

    def call(self, index: int, *args, **kwargs):
        signature = call_signature(self.blocks[index], args, kwargs)
        if index == 0:
            self.replaying = self.serves(signature, args, kwargs)
        if self.replaying and self.graphs[index].signature == signature:
            graph = self.graphs[index]
            if index == 0:
                self.backward_pending = True
            return graph.unflatten(_Replay.apply(self, graph, args[0], *graph.params))
        self.replaying = False
        return self.eager_forwards[index](*args, **kwargs)

    def serves(self, signature: tuple | None, args: tuple, kwargs: dict) -> bool:
        """Whether a forward starting with this call of the first block (of ``signature``) replays the graphs
        (capturing them first if it is the first such call)."""
        if self.failed or signature is None:
            return False
        if self.backward_pending or (self.graphs and self.graphs[0].gradients_held()):
            # A replay writes into the graphs' memory pool, where the last replayed forward keeps what its backward
            # reads and where autograd keeps the gradients the backward graphs returned (it adopts them as .grad):
            # a forward begun before that backward, or a later micro-batch of a step, runs eagerly.
            if not self.warned_eager:
                self.warned_eager = True
                logger.info(
                    "A forward before the last replayed one's backward, or a step's later micro-batch, runs its "
                    "blocks eagerly (CUDA graphs replay a step's first micro-batch)"
                )
            return False
        if not self.graphs:
            self.capture(args, kwargs)
        return bool(self.graphs) and self.graphs[0].signature == signature

    def capture(self, args: tuple, kwargs: dict) -> None:
        hidden = args[0]
        rest = args[1:]
        try:
            # Autocast's cache would hand the capture the weights it cast before (a replay would then read those,
            # never the updated weights): off while the blocks warm up and are captured.
            with torch.autocast(
                "cuda",
                dtype=torch.get_autocast_dtype("cuda"),
                enabled=torch.is_autocast_enabled("cuda"),
                cache_enabled=False,
            ):
                graphs = self._capture(hidden, rest, kwargs)
        except Exception as error:  # a kernel that syncs with the host, or outputs that do not chain
            self.failed = True
            torch.cuda.synchronize()
            reason = (str(error).strip().splitlines() or [type(error).__name__])[-1]
            logger.warning(
                "The blocks run eagerly: capturing them as CUDA graphs failed (%s: %s)",
                type(error).__name__,
                reason,
            )
            return
        self.graphs = graphs
        logger.info(
            "Captured %d blocks as CUDA graphs for hidden states of shape %s",
            len(graphs),
            tuple(hidden.shape),
        )

    def _capture(self, hidden: torch.Tensor, rest: tuple, kwargs: dict) -> list["_BlockGraph"]:
        sample = hidden.detach().clone().requires_grad_(hidden.requires_grad)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            x = sample
            for forward, block in zip(self.eager_forwards, self.blocks, strict=True):
                for _ in range(WARMUP_ITERATIONS):
                    outputs = [o for o in tree_flatten(forward(x, *rest, **kwargs))[0] if torch.is_tensor(o)]
                    if not outputs or outputs[0].shape != x.shape or outputs[0].dtype != x.dtype:
                        raise ValueError("a block's first output is not hidden states shaped as its input")
                    differentiable = [o for o in outputs if o.requires_grad]
                    inputs = [t for t in (x, *trainable(block)) if t.requires_grad]
                    if differentiable:
                        torch.autograd.grad(
                            differentiable,
                            inputs,
                            [torch.ones_like(o) for o in differentiable],
                            allow_unused=True,
                        )
                x = outputs[0].detach().requires_grad_(outputs[0].requires_grad)
                del outputs, differentiable
        torch.cuda.synchronize()

        pool = torch.cuda.graph_pool_handle()
        graphs = []
        x = sample
        for forward, block in zip(self.eager_forwards, self.blocks, strict=True):
            graph = _BlockGraph(x, trainable(block), call_signature(block, (x, *rest), kwargs))
            with torch.cuda.graph(graph.forward, pool=pool, capture_error_mode="thread_local"):
                structure = forward(x, *rest, **kwargs)
            graph.set_outputs(structure)
            graphs.append(graph)
            x = graph.outputs[0].detach().requires_grad_(graph.outputs[0].requires_grad)
        grad_output = None
        for graph in reversed(graphs):
            with torch.cuda.graph(graph.backward, pool=pool, capture_error_mode="thread_local"):
                graph.capture_backward(grad_output)
            grad_output = graph.grad_input
        torch.cuda.synchronize()
        for graph in graphs:
            graph.release_autograd()
        return graphs


class _BlockGraph:
    """One block's forward and backward graphs and the tensors they read and write."""

    def __init__(self, hidden: torch.Tensor, params: tuple[nn.Parameter, ...], signature: tuple):
        self.hidden = hidden  # the forward's input buffer (the previous block's output buffer)
        self.params = params
        self.signature = signature  # of the calls this graph serves
        self.forward = torch.cuda.CUDAGraph()
        self.backward = torch.cuda.CUDAGraph()

    def set_outputs(self, structure) -> None:
        leaves, self.spec = tree_flatten(structure)
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
        self.outputs = tuple(leaves[i] for i in self.tensor_positions)
        self.leaves = [
            None if torch.is_tensor(leaf) else leaf for leaf in leaves
        ]  # the tensors come from replays

    def release_autograd(self) -> None:
        """Drop the capture's autograd graph, which the outputs' grad_fn held: its nodes would otherwise go on
        serving the parameters' gradient accumulation in training, bound to the capture's stream."""
        self.outputs = tuple(o.detach() for o in self.outputs)

    def gradients_held(self) -> bool:
        """Whether a parameter holds a gradient (an earlier micro-batch's: the step's optimizer has not run)."""
        return any(p.grad is not None for p in self.params)

    def unflatten(self, outputs: tuple[torch.Tensor, ...]):
        leaves = list(self.leaves)
        for position, output in zip(self.tensor_positions, outputs, strict=True):
            leaves[position] = output
        return tree_unflatten(leaves, self.spec)

    def capture_backward(self, hidden_grad: torch.Tensor | None) -> None:
        """Gradients of the differentiable outputs; the hidden states' output gradient is read from ``hidden_grad``
        (the next block's input-gradient buffer) so that nothing is copied between the blocks' backward graphs."""
        self.grad_outputs = [
            None
            if not o.requires_grad
            else (hidden_grad if i == 0 and hidden_grad is not None else torch.empty_like(o))
            for i, o in enumerate(self.outputs)
        ]
        differentiable = [o for o in self.outputs if o.requires_grad]
        inputs = [t for t in (self.hidden, *self.params) if t.requires_grad]
        grads = iter(
            torch.autograd.grad(
                differentiable,
                inputs,
                [g for g in self.grad_outputs if g is not None],
                allow_unused=True,
            )
            if differentiable
            else [None] * len(inputs)
        )
        self.grad_input = next(grads) if self.hidden.requires_grad else None
        self.param_grads = [next(grads) if p.requires_grad else None for p in self.params]


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner: BlockGraphs, graph: _BlockGraph, hidden: torch.Tensor, *params: torch.Tensor):
        ctx.owner, ctx.graph = owner, graph
        if hidden.data_ptr() != graph.hidden.data_ptr():
            graph.hidden.copy_(hidden)
        graph.forward.replay()
        return tuple(o.detach() for o in graph.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        graph = ctx.graph
        for buffer, grad in zip(graph.grad_outputs, grads, strict=True):
            if buffer is not None and buffer.data_ptr() != grad.data_ptr():
                buffer.copy_(grad)
        graph.backward.replay()
        if graph is ctx.owner.graphs[0]:
            ctx.owner.backward_pending = False
        grad_input = None if graph.grad_input is None else graph.grad_input.detach()
        return None, None, grad_input, *(None if g is None else g.detach() for g in graph.param_grads)


def trainable(block: nn.Module) -> tuple[nn.Parameter, ...]:
    return tuple(p for p in block.parameters() if p.requires_grad)


def call_signature(block: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """What a graph replay must match, or None for a call the graphs do not serve."""
    if not (
        args and torch.is_tensor(args[0]) and args[0].is_cuda and block.training and torch.is_grad_enabled()
    ):
        return None
    leaves, spec = tree_flatten((args[1:], kwargs))
    if any(torch.is_tensor(leaf) for leaf in leaves):
        return None
    hidden = args[0]
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return (spec, tuple(leaves), hidden.shape, hidden.dtype, hidden.device, hidden.requires_grad, autocast)


def graph_blocks(stacks: list[nn.Module]) -> list[BlockGraphs]:
    """Replay each stack's blocks as CUDA graphs (captured at the first training step)."""
    return [BlockGraphs(list(stack.children())) for stack in stacks]
