"""Blocks that run eagerly replayed as CUDA graphs: the host issues a block's forward or backward as one graph
launch instead of its dozens of kernels, for the models whose blocks torch.compile leaves eager (FLA's classes,
``ModelSpec.eager_blocks``), whose small steps are bound by the host's kernel launches (docs/performance.md, "FLA
classes, compiled and eager").

The idea is torch.cuda.make_graphed_callables': warm every block up, capture each block's forward in order and each
backward in reverse into one memory pool (the order the training step replays them in, so a replay never
overwrites memory a later one still reads), and replay them from an autograd Function. flame captures its own so
that each block is captured at its own first training call, with the tensors that call passes (a per-layer tensor
such as HGRN's ``lower_bound``, or RWKV7's ``v_first`` that the first block returns and every later one reads);
so that one block's output buffer is the next block's input buffer and its input-gradient buffer the previous
block's output-gradient buffer (nothing is copied between blocks); and so that a call unlike the captured one
(another shape, evaluation, no grad, packed documents' boundaries) runs the block's own forward. The forward that
captures replays each block's graph as soon as it is captured, on the buffers the capture read (which hold that
call's tensors, so nothing is copied into them: a copy would bump the version counters that the capture's autograd
graph checks when the backward is captured, "modified by an inplace operation" on an H200). Its activations are
therefore the graphs' pool and nothing beside it: the capturing step's peak memory is a replayed step's, not the
eager activations plus the pool.

A step's first micro-batch replays; the later ones run eagerly. The backward graphs' parameter gradients live in
the pool, autograd adopts them as ``.grad``, and a later micro-batch's forward replay would overwrite them before
the optimizer reads them (which torch's make_graphed_callables leaves to its caller: two micro-batches gave gradient
norms of 843 against the eager blocks' 5.9 on an H200).

The graphs can capture each block compiled (``compile``: torch.compile's options): inductor then fuses the block's
elementwise work around FLA's kernels, and the compiled regions' guards and wrappers, which cost a compiled block
more host time than inductor saved (docs/performance.md, "FLA classes, compiled and eager"), run only while warming
up and capturing. A block that fails compiled and runs eagerly is captured eagerly, with one log line. Calls the graphs do not
serve run the block's own forward, uncompiled.

flame's own families' compiled blocks replay the same way (``compiled_unserved``): their compiled GatedDeltaNet
block's host work (FLA's op wrappers, Triton's launcher and autotuner dispatch for each of its kernels) took as long
as its kernels on an H100's host (docs/performance.md, "Where a compiled GatedDeltaNet step's host time goes"). Their
blocks take the positions as an integer tensor, read on the GPU only, which is a graph input like the hidden states
(``integers_on_gpu`` says which calls' integer tensors are); the calls the graphs do not serve (packed documents,
evaluation, later micro-batches) run the compiled blocks.

One GPU only (a data-parallel or sharded step's hooks and collectives sit between the blocks), without activation
checkpointing or offloading (they re-run or move what the forward graph keeps in its pool).
"""

import contextlib
import copy
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torchtitan.tools.logging import logger

from flame.compat import end_failed_capture
from flame.errors import first_line

# Triton's compilation and autotuning, cuBLAS's workspaces, and torch.compile's compilation: all before the capture.
# A compiled block may compile again at its second call, where its first changed state that its graph guards on
# (nsa's and parallax's blocks: FLA's rotary tables, built at the first call); compiling syncs, so that happens
# before the last, sync-refused iteration.
WARMUP_ITERATIONS = 3


class BlockGraphs:
    """The blocks of one stack (called in order, each on the previous one's first output), replayed as CUDA
    graphs. The first training forward that the graphs can serve captures each block at its call, with that call's
    tensors, and replays it at once; once the last block, or the first block the graphs cannot serve, is reached,
    the captured blocks' backward graphs are captured too (the captured blocks form a prefix of the stack). A
    failed capture, forward or backward, is one log line, and every later forward runs the blocks' own forward (eager,
    or compiled with ``compiled_unserved``); the blocks the capturing forward replayed get their gradients by running
    each block's forward again eagerly on the inputs its graph kept (the values it replayed on). A host sync in a block (``.item()``, a copy to or from the host) is
    found in the last warm-up, under torch's sync debug mode, before any capture; after a capture that fails,
    torch's CUDA state is put back as it was before it (torch 2.11 leaves the random generator capturing, so that
    a later ``torch.randn`` on the GPU would raise: flame.compat.end_failed_capture). The capture needs no earlier
    autograd graph alive (a loss or logits kept with their ``grad_fn``): the parameters' gradient accumulators stay
    bound to the stream that graph ran on, and capturing the backward then fails ("operation would make the legacy
    stream depend on a capturing blocking stream"; torch 2.11, H100). The trainer keeps none between steps.

    A call is served when it is a training call (module in training mode, grad enabled) on CUDA whose structure,
    constants, tensors' shapes, dtypes, strides and ``requires_grad``, and autocast state equal the captured
    call's, when no parameter holds a gradient yet (a step's first micro-batch) and the last replayed forward's
    backward has run. Every other call runs the block's own forward."""

    def __init__(
        self,
        blocks: list[nn.Module],
        compile: dict | None = None,
        integers_on_gpu: Callable[[tuple, dict], bool] | None = None,
        compiled_unserved: bool = False,
    ):
        self.blocks = blocks
        self.eager_forwards = [block.forward for block in blocks]
        # What the graphs capture: the compiled forwards until one fails to compile, then the eager ones.
        self.captured_forwards = (
            [torch.compile(forward, fullgraph=False, **compile) for forward in self.eager_forwards]
            if compile is not None
            else self.eager_forwards
        )
        # Whether a call's integer tensors are graph inputs (read on the GPU only); None: no such call is served.
        self.integers_on_gpu = integers_on_gpu
        # Calls the graphs do not serve run the captured (compiled) forwards, not the eager ones.
        self.compiled_unserved = compiled_unserved
        self.unserved = "without CUDA graphs" if compiled_unserved else "eagerly"
        self.graphs: list[_BlockGraph] = []  # the captured prefix of the stack
        self.pool = None
        self.warmup_stream = None
        self.capturing = False  # a forward is capturing its blocks as they are called
        # While capturing: the output buffer of the graph that wrote each tensor returned so far, by output_key.
        self.written: dict[tuple, torch.Tensor] = {}
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
        leaves, spec = tree_flatten((args, kwargs))  # once per call: the host's time is what the graphs save
        integers = self.integers_on_gpu is not None and self.integers_on_gpu(args, kwargs)
        signature = leaves_signature(self.blocks[index], args, leaves, spec, integers)
        if index == 0:
            self.replaying = self.serves(signature)
        if self.capturing:
            if (
                index == len(self.graphs)
                and signature is not None
                and self.capture(index, args, kwargs, signature)
            ):
                graph = self.graphs[index]
                self.backward_pending = True
                # The graph's input buffers hold these tensors' values: the replay copies nothing into them.
                tensors = [leaf for leaf in leaves if torch.is_tensor(leaf)]
                outputs = _Replay.apply(self, graph, *tensors, *graph.params)
                self.remember(graph, outputs)
                if index == len(self.blocks) - 1:
                    self.finish_capture()
                return graph.unflatten(outputs)
            self.finish_capture()
            return self.own_forward(index)(*args, **kwargs)
        if self.replaying and index < len(self.graphs) and self.graphs[index].signature == signature:
            graph = self.graphs[index]
            if index == 0:
                self.backward_pending = True
            tensors = [leaf for leaf in leaves if torch.is_tensor(leaf)]
            return graph.unflatten(_Replay.apply(self, graph, *tensors, *graph.params))
        self.replaying = False
        return self.own_forward(index)(*args, **kwargs)

    def own_forward(self, index: int):
        """What runs a call the graphs do not serve: the block's eager forward, or with ``compiled_unserved`` the
        compiled one."""
        return (self.captured_forwards if self.compiled_unserved else self.eager_forwards)[index]

    def serves(self, signature: tuple | None) -> bool:
        """Whether a forward whose first block call has this signature replays the graphs; the first one that
        could, while none are captured, captures them instead."""
        if self.capturing:  # a capturing forward that stopped before its stack's last block
            self.finish_capture()
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
                    "blocks %s (CUDA graphs replay a step's first micro-batch)",
                    self.unserved,
                )
            return False
        if not self.graphs:
            self.capturing = True
            return False
        return self.graphs[0].signature == signature

    def capture(self, index: int, args: tuple, kwargs: dict, signature: tuple) -> bool:
        """Capture block ``index``'s forward for this call; on failure, drop every graph (the blocks this forward
        replayed get their gradients by recomputation)."""
        try:
            with uncached_autocast():
                graph = self._capture_forward(index, args, kwargs, signature)
        except Exception as error:  # a kernel that syncs with the host, outputs that do not chain, memory
            self.fail(f"capturing block {index} as a CUDA graph", error)
            return False
        self.graphs.append(graph)
        return True

    def remember(self, graph: "_BlockGraph", outputs: tuple[torch.Tensor, ...]) -> None:
        """Where a replay of ``graph`` leaves each tensor the capturing forward's replay returned."""
        for tensor, buffer in zip(outputs, graph.outputs, strict=True):
            self.written[output_key(tensor)] = buffer

    def fail(self, what: str, error: Exception) -> None:
        self.failed, self.capturing, self.graphs, self.written = True, False, [], {}
        torch.cuda.synchronize()
        cause = capture_failure(error)
        logger.warning(
            "The blocks run %s: %s failed (%s: %s)%s",
            self.unserved,
            what,
            type(cause).__name__,
            first_line(cause),
            LIVE_GRAPH_HINT if LIVE_GRAPH_ERROR in str(cause) else "",
        )

    def _capture_forward(self, index: int, args: tuple, kwargs: dict, signature: tuple) -> "_BlockGraph":
        block = self.blocks[index]
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
        # An input that an earlier block returned (the previous block's hidden states, RWKV7's v_first) is read from
        # that block's graph's output buffer; any other is copied into a buffer of its own at each replay.
        inputs = []
        for position in positions:
            tensor = leaves[position]
            buffer = self.written.get(output_key(tensor))
            if buffer is None:
                buffer = tensor.detach().clone()
            inputs.append(buffer.detach().requires_grad_(tensor.requires_grad))

        params = trainable(block)
        run = self._warmed_up(index, _Call(self.captured_forwards[index], leaves, spec), inputs, params)

        graph = _BlockGraph(index, tuple(inputs), params, signature, run)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with self.capturing_into(graph.forward):
            structure = run(inputs)
        graph.set_outputs(structure)
        return graph

    @contextlib.contextmanager
    def capturing_into(self, graph: torch.cuda.CUDAGraph):
        """Capture into ``graph`` in the graphs' pool; a capture that fails leaves torch's CUDA state as it was
        before it (flame.compat.end_failed_capture), so that the blocks go on training without graphs."""
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                yield
        except Exception:
            end_failed_capture(self.pool)
            raise

    def _warmed_up(self, index: int, run: "_Call", inputs: list[torch.Tensor], params) -> "_Call":
        """``run`` warmed up for its capture; where it is compiled and fails, and the block's eager forward does
        not, that one warmed up instead (and every later block's: they share their code). With
        ``compiled_unserved`` the failure stands: the calls the graphs do not serve run the compiled blocks, which
        then meet the error themselves."""
        try:
            self._warm_up_all(run, inputs, params)
            return run
        except Exception as error:
            if self.captured_forwards is self.eager_forwards or self.compiled_unserved:
                raise
            compiled_error = error
        run = run.with_forward(self.eager_forwards[index])
        self._warm_up_all(run, inputs, params)
        self.captured_forwards = self.eager_forwards
        logger.warning(
            "The blocks are captured uncompiled: compiled, block %d failed (%s: %s)",
            index,
            type(compiled_error).__name__,
            first_line(compiled_error),
        )
        return run

    def _warm_up_all(self, run: "_Call", inputs: list[torch.Tensor], params) -> None:
        torch.cuda.synchronize()
        if self.warmup_stream is None:  # one for every block: the allocator caches freed memory per stream
            self.warmup_stream = torch.cuda.Stream()
        # Without autocast's cache, as in the capture: a compiled block's guards read that state.
        with torch.cuda.stream(self.warmup_stream), uncached_autocast():
            for iteration in range(WARMUP_ITERATIONS):
                # The first ones may tune kernels and compile, which sync; the last must not sync, as in a capture.
                with host_syncs_refused(iteration == WARMUP_ITERATIONS - 1):
                    self._warm_up(run, inputs, params)
        torch.cuda.synchronize()

    @staticmethod
    def _warm_up(run: "_Call", inputs: list[torch.Tensor], params: tuple[nn.Parameter, ...]) -> None:
        """One eager forward and backward of the block on copies of its inputs."""
        sample = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        outputs = [o for o in tree_flatten(run(sample))[0] if torch.is_tensor(o)]
        if not outputs or outputs[0].shape != sample[0].shape or outputs[0].dtype != sample[0].dtype:
            raise ValueError("a block's first output is not hidden states shaped as its input")
        with backward_autocast():
            gradients([(o, torch.ones_like(o)) for o in outputs if o.requires_grad], (*sample, *params))

    def finish_capture(self) -> None:
        """Capture the captured blocks' backward graphs, in reverse, after all their forwards (the replay order)."""
        self.capturing, self.written = False, {}
        if not self.graphs:
            return
        try:
            self._capture_backward()
        except Exception as error:
            self.fail("capturing the blocks' backward as CUDA graphs", error)
            return
        logger.info(
            "Captured %d of %d blocks as CUDA graphs for hidden states of shape %s; they replay from the next "
            "training forward",
            len(self.graphs),
            len(self.blocks),
            tuple(self.graphs[0].inputs[0].shape),
        )

    def _capture_backward(self) -> None:
        with backward_autocast():
            later = None
            for graph in reversed(self.graphs):
                chained = later is not None and output_key(later.inputs[0]) == output_key(graph.outputs[0])
                with self.capturing_into(graph.backward):
                    graph.capture_backward(later.input_grads[0] if chained else None)
                later = graph
        torch.cuda.synchronize()
        for graph in self.graphs:
            graph.backward_captured = True
            graph.release_autograd()


# What CUDA says when a capture's backward meets a parameter whose gradient accumulator an earlier autograd graph
# keeps bound to the legacy stream (the BlockGraphs docstring), and what the log line adds to it.
LIVE_GRAPH_ERROR = "make the legacy stream depend on a capturing blocking stream"
LIVE_GRAPH_HINT = (
    "; an autograd graph from before the capture was still alive (a loss or logits kept with their grad_fn): "
    "drop it before the first training forward"
)


def capture_failure(error: BaseException) -> BaseException:
    """The error that made a capture fail: the one raised inside the capture, not the report of the capture's end
    that an earlier error invalidated it (which torch raises from the first one's handling)."""
    while "previous error during capture" in str(error) and error.__context__ is not None:
        error = error.__context__
    return error


class _Call:
    """A block's call with its tensors replaced: ``_Call(forward, leaves, spec)(tensors)`` calls ``forward`` on the
    call that ``leaves`` and ``spec`` flatten, with its tensor leaves taken from ``tensors`` in order (the call's own
    tensors are not kept)."""

    def __init__(self, forward, leaves: list, spec):
        self.forward, self.spec = forward, spec
        self.positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
        self.leaves = [None if torch.is_tensor(leaf) else leaf for leaf in leaves]

    def with_forward(self, forward) -> "_Call":
        call = copy.copy(self)
        call.forward = forward
        return call

    def __call__(self, tensors):
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.forward(*args, **kwargs)


class _BlockGraph:
    """One block's forward and backward graphs and the tensors they read and write."""

    def __init__(
        self,
        index: int,
        inputs: tuple[torch.Tensor, ...],
        params: tuple[nn.Parameter, ...],
        signature: tuple,
        call: _Call,
    ):
        self.index = index  # the block's place in its stack
        self.inputs = inputs  # the call's tensors, hidden states first: the forward's input buffers
        self.params = params
        self.signature = signature  # of the calls this graph serves
        self.call = call  # the block's own forward on tensors in the inputs' order
        self.forward = torch.cuda.CUDAGraph()
        self.backward = torch.cuda.CUDAGraph()
        self.backward_captured = False

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
        pairs = [(o, g) for o, g in zip(self.outputs, self.grad_outputs, strict=True) if g is not None]
        grads = gradients(pairs, (*self.inputs, *self.params))
        self.input_grads, self.param_grads = grads[: len(self.inputs)], grads[len(self.inputs) :]

    def recompute_gradients(self, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        """The inputs' and parameters' gradients (in that order) from the block's own forward run again eagerly on
        the input buffers, which hold the values the capturing forward replayed on: the backward of that forward
        where capturing the backward graphs failed."""
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in self.inputs]
        enabled, dtype = self.signature[-1]
        with torch.enable_grad(), torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
            outputs = [o for o in tree_flatten(self.call(inputs))[0] if torch.is_tensor(o)]
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad and g is not None]
        with backward_autocast():
            return gradients(pairs, (*inputs, *self.params))


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner: BlockGraphs, graph: _BlockGraph, *tensors: torch.Tensor):
        ctx.owner, ctx.graph = owner, graph
        if not owner.capturing:  # a capturing forward's buffers hold its tensors already
            # The parameters follow the inputs in ``tensors``: zip stops at the last input buffer.
            for buffer, tensor in zip(graph.inputs, tensors, strict=False):
                if buffer.data_ptr() != tensor.data_ptr():
                    buffer.copy_(tensor)
        graph.forward.replay()
        return tuple(o.detach() for o in graph.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        owner, graph = ctx.owner, ctx.graph
        if owner.capturing:  # a capturing forward that stopped before its stack's last block
            owner.finish_capture()
        if graph.index == 0:
            owner.backward_pending = False
        if not graph.backward_captured:
            return (None, None, *graph.recompute_gradients(grads))
        for buffer, grad in zip(graph.grad_outputs, grads, strict=True):
            if buffer is not None and buffer.data_ptr() != grad.data_ptr():
                buffer.copy_(grad)
        graph.backward.replay()
        return (
            None,
            None,
            *(None if g is None else g.detach() for g in graph.input_grads),
            *(None if g is None else g.detach() for g in graph.param_grads),
        )


def gradients(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], tensors: tuple[torch.Tensor, ...]
) -> list[torch.Tensor | None]:
    """The gradient of the (output, output gradient) ``pairs`` with respect to each of ``tensors`` that requires
    one, None for the others (and for one no output depends on)."""
    wrt = [t for t in tensors if t.requires_grad]
    found = iter(
        torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        if pairs
        else [None] * len(wrt)
    )
    return [next(found) if t.requires_grad else None for t in tensors]


@contextlib.contextmanager
def host_syncs_refused(refused: bool = True):
    """Within it (where ``refused``), an operation that waits on the GPU from the host raises, as it would in a
    capture: torch's sync debug mode set to "error", then put back."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error" if refused else before)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def uncached_autocast() -> torch.autocast:
    """The current CUDA autocast state without its cache: with it, a capture would read the weights autocast cast
    before (a replay would then read those, never the weights the optimizer updates in place)."""
    return torch.autocast(
        "cuda",
        dtype=torch.get_autocast_dtype("cuda"),
        enabled=torch.is_autocast_enabled("cuda"),
        cache_enabled=False,
    )


def backward_autocast() -> torch.autocast:
    """Autocast as the training step's backward runs it: off (the step calls backward outside its autocast
    region; custom autograd functions restore their forward's state themselves), so that the captured backward runs
    the kernels the step's backward runs. Under the forward's autocast, abc's block capture met a Triton compilation
    error ("Both operands must be same dtype") that its eager steps did not (FLA 0.6.0, H200)."""
    return torch.autocast("cuda", enabled=False)


def trainable(block: nn.Module) -> tuple[nn.Parameter, ...]:
    return tuple(p for p in block.parameters() if p.requires_grad)


def output_key(tensor: torch.Tensor) -> tuple:
    """Tensors with equal keys are the same memory seen the same way."""
    return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)


def call_signature(
    block: nn.Module, args: tuple, kwargs: dict, integers_on_gpu: bool = False
) -> tuple | None:
    """What a graph replay must match, or None for a call the graphs do not serve."""
    return leaves_signature(block, args, *tree_flatten((args, kwargs)), integers_on_gpu)


def leaves_signature(
    block: nn.Module, args: tuple, leaves: list, spec, integers_on_gpu: bool = False
) -> tuple | None:
    """call_signature of a call whose (args, kwargs) flatten to ``leaves`` and ``spec``; with ``integers_on_gpu``
    its CUDA integer tensors are graph inputs too."""
    if not (
        args and torch.is_tensor(args[0]) and args[0].is_cuda and block.training and torch.is_grad_enabled()
    ):
        return None
    described = []
    for leaf in leaves:
        if not torch.is_tensor(leaf):
            described.append(leaf)
        elif leaf.is_cuda and (leaf.dtype.is_floating_point or integers_on_gpu):
            described.append((leaf.shape, leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            # Integer tensors (packed documents' boundaries, a mask) may steer kernels from the host: not graph
            # inputs unless the caller says they are read on the GPU only.
            return None
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return (spec, tuple(described), autocast)


def graph_blocks(
    stacks: list[nn.Module],
    compile: dict | None = None,
    integers_on_gpu: Callable[[tuple, dict], bool] | None = None,
    compiled_unserved: bool = False,
) -> list[BlockGraphs]:
    """Replay each stack's blocks as CUDA graphs (each block captured at its first training call, compiled with
    torch.compile's options ``compile`` where given); BlockGraphs says what the other arguments do."""
    return [
        BlockGraphs(list(stack.children()), compile, integers_on_gpu, compiled_unserved) for stack in stacks
    ]
