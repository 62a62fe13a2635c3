"""Context parallelism: every row's sequence split into contiguous slices over the ranks of a group, and the three
exchanges flame's mixers need to compute, on each slice, exactly what one process computes on the whole sequence.

Rank r of W holds positions [r L, (r + 1) L) of every row (L = T / W; `shard_sequence`). While a group is active
(`sequence_sharded(group)`, which the trainer enters around each forward + backward) the mixers call:

- `prefix_attention` (attention, through `gather_prefix`): keys and values of positions [0, (r + 1) L),
  all-gathered. Queries stay local and read them with bottom-right causal alignment (flame.ops.attention accepts
  fewer queries than keys). Backward, the gradient of each slice is summed over the ranks that read it. Only K/V grow with the whole sequence; the scores
  are never materialized beyond what the kernel does for one slice of queries.
- `previous_tokens` (short convolutions): the last n tokens of rank r - 1's slice (zeros on rank 0, which is the
  convolution's own zero padding), so the convolution sees across the slice boundary; backward, their gradient
  goes back to rank r - 1.
- `relay_state` (recurrences: GatedDeltaNet, DeltaNet): rank r starts from rank r - 1's final state and hands its
  own final state to rank r + 1; backward, the state's gradient travels from rank r + 1 to rank r. The ranks run
  their recurrences one after another (projections, convolutions, MLPs and attention run in parallel). FLA 0.6's
  affine-chain CP (fla/ops/cp) parallelises the recurrence itself on NVIDIA GPUs; it is not wired in.

Packed documents (one row, ``cu_seqlens``): the trainer passes the whole row's cu_seqlens to
`sequence_sharded(group, cu_seqlens)`, and every rank's model gets the boundaries of its own slice
(`clip_cu_seqlens`; a document cut by a slice border is a document of each slice). The short convolution
convolves the previous tokens and its slice with the boundaries of that window (`window_cu_seqlens`), so tokens of
an earlier document are never read; the relay hands over the state of the slice's last document, and rank r starts
its first document from it only when that document began on an earlier rank (no state crosses a border that is
also a document boundary, and the two ranks then run their recurrences at the same time). Attention reads the
earlier ranks' keys only for the slice's first document, from the position that document began.

Under tensor parallelism the mixers pass plain local tensors of their own heads (or channels), and the exchanges
move only those over the cp group (torchtitan's "cp" mesh: the ranks that hold the same heads of the other
slices).

With no active group every function is the single-process computation, so validation, text samples and export
run the same modules on whole sequences. The exchanges use all_gather, all_reduce and send/recv, which both gloo
(CPU tests) and NCCL provide.
"""

import bisect
import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from flame.ops.dispatch import not_traced

_active_group: dist.ProcessGroup | None = None
# The whole row's cu_seqlens as Python ints (packed documents), or None for fixed-length rows.
_active_boundaries: list[int] | None = None


@contextlib.contextmanager
def sequence_sharded(group: dist.ProcessGroup | None, cu_seqlens: Tensor | None = None) -> Iterator[None]:
    """Run the enclosed forward and backward with sequences split over ``group`` (None: not split); ``cu_seqlens``:
    the document boundaries of the whole packed row (the same on every rank of the group), None without packing."""
    global _active_group, _active_boundaries
    previous = _active_group, _active_boundaries
    # One host copy per micro-batch: the exchanges decide in Python which borders a document crosses.
    _active_group, _active_boundaries = group, None if cu_seqlens is None else cu_seqlens.tolist()
    try:
        yield
    finally:
        _active_group, _active_boundaries = previous


def active_group() -> dist.ProcessGroup | None:
    """The context-parallel group of the running forward / backward, or None."""
    return _active_group


def clip_cu_seqlens(cu_seqlens: Sequence[int], start: int, end: int) -> list[int]:
    """The cu_seqlens of positions [start, end) of a packed row with boundaries ``cu_seqlens``: the documents cut
    by start or end become its first or last document. A negative start counts positions before the row (the
    zeros of `previous_tokens` on rank 0) as one document of their own."""
    return [0, *(b - start for b in cu_seqlens if start < b < end), end - start]


# Not traced by torch.compile: the row's boundaries change every batch, and traced they would be constants that
# recompile the block each time.
@not_traced
def window_cu_seqlens(length: int, before: int, device: torch.device) -> Tensor | None:
    """cu_seqlens of the ``before`` tokens preceding this rank's slice of ``length`` tokens followed by the slice
    (what a short convolution sees under context parallelism); None without packed documents."""
    if _active_boundaries is None:
        return None
    start = dist.get_rank(_active_group) * length
    window = clip_cu_seqlens(_active_boundaries, start - before, start + length)
    return torch.tensor(window, dtype=torch.int32, device=device)


def shard_sequence(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (the sequence), which the group size must divide."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"sequence length {x.shape[dim]} is not divisible by the context-parallel degree {world}"
        )
    return x.chunk(world, dim)[rank]


def _gather_slices(x: Tensor, group: dist.ProcessGroup) -> list[Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _GatherPrefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        rank = dist.get_rank(group)
        return torch.cat(_gather_slices(x, group)[: rank + 1], dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        length = grad.shape[1] // (rank + 1)
        # [W, B, L, ...]: slice j's gradient from this rank (zero for the slices it did not read).
        per_slice = grad.new_zeros((world, grad.shape[0], length, *grad.shape[2:]))
        per_slice[: rank + 1] = grad.unflatten(1, (rank + 1, length)).movedim(1, 0)
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = grad.new_empty(per_slice.shape[1:])
            dist.reduce_scatter_tensor(out, per_slice, group=group)
            return out, None
        dist.all_reduce(per_slice, group=group)  # gloo has no reduce-scatter
        return per_slice[rank].clone(), None


def gather_prefix(x: Tensor) -> Tensor:
    """[B, L, ...] -> [B, (r + 1) L, ...]: the slices of ranks 0..r of the active group, in order."""
    group = _active_group
    if group is None:
        return x
    return _GatherPrefix.apply(x, group)


def prefix_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, attend: Callable[..., Tensor]
) -> Tensor:
    """Causal attention of this rank's queries [B, L, H, D] on every key they may see. ``attend(q, k, v,
    cu_seqlens=...)`` is the attention of queries aligned to the end of their keys (flame.ops.attention).

    Fixed-length rows: the keys and values of positions [0, (r + 1) L), gathered. Packed documents (one row;
    ``cu_seqlens`` are this slice's): only the slice's first document can have begun on an earlier rank. Its
    queries attend to the gathered keys from that document's start, the slice's other documents to their own keys,
    in two calls, so no query sees another document. Every rank takes its keys from the gathered tensor, so every
    rank's backward joins the gather's collective."""
    group = _active_group
    if group is None:
        return attend(q, k, v, cu_seqlens=cu_seqlens)
    kv = gather_prefix(torch.cat([k, v], dim=-1))
    keys, values = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    if _active_boundaries is None:
        return attend(q, keys, values, cu_seqlens=None)
    return _packed_prefix_attention(q, keys, values, cu_seqlens, attend)


# Not traced by torch.compile, like window_cu_seqlens: the slicing follows the row's boundaries, which change every
# batch.
@not_traced
def _packed_prefix_attention(
    q: Tensor, keys: Tensor, values: Tensor, cu_seqlens: Tensor, attend: Callable[..., Tensor]
) -> Tensor:
    """prefix_attention on one packed row; keys / values: the gathered positions [0, (r + 1) L)."""
    rank, length = dist.get_rank(_active_group), q.shape[1]
    start = rank * length
    if not _document_crosses(
        rank, _active_group
    ):  # the slice starts a document: its own keys are all it sees
        return attend(q, keys[:, start:], values[:, start:], cu_seqlens=cu_seqlens)
    after = bisect.bisect_right(_active_boundaries, start)  # the first boundary after the slice's start
    document_start = _active_boundaries[after - 1]
    first_end = min(_active_boundaries[after] - start, length)  # in the slice
    first = attend(
        q[:, :first_end],
        keys[:, document_start : start + first_end],
        values[:, document_start : start + first_end],
        cu_seqlens=None,
    )
    if first_end == length:
        return first
    rest = attend(
        q[:, first_end:],
        keys[:, start + first_end :],
        values[:, start + first_end :],
        cu_seqlens=cu_seqlens[1:] - first_end,
    )
    return torch.cat([first, rest], dim=1)


class _PreviousTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, n: int, group: dist.ProcessGroup) -> Tensor:
        ctx.group, ctx.shape = group, x.shape
        rank = dist.get_rank(group)
        tails = _gather_slices(x[:, x.shape[1] - n :], group)
        return tails[rank - 1] if rank > 0 else torch.zeros_like(tails[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        # Rank r + 1 read this rank's tail: its gradient for the borrowed tokens is this tail's gradient.
        grads = _gather_slices(grad, group)
        grad_x = grad.new_zeros(ctx.shape)
        if rank < world - 1:
            grad_x[:, ctx.shape[1] - grad.shape[1] :] = grads[rank + 1]
        return grad_x, None, None


def previous_tokens(x: Tensor, n: int) -> Tensor | None:
    """The n tokens before this rank's slice of x [B, L, ...] (zeros on the first rank); None with no active
    group, where nothing precedes the sequence."""
    group = _active_group
    if group is None:
        return None
    if x.shape[1] < n:
        raise ValueError(
            f"a context-parallel slice of {x.shape[1]} tokens is shorter than the {n} tokens needed"
        )
    return _PreviousTokens.apply(x, n, group)


def _keep(x: Tensor) -> Tensor:
    return x


def _document_crosses(border: int, group: dist.ProcessGroup) -> bool:
    """Whether the sequence runs on across the start of rank ``border``'s slice (a recurrent state or attention
    keys cross it): always for fixed-length rows; for packed documents only where a document runs across."""
    if _active_boundaries is None:
        return True
    length = _active_boundaries[-1] // dist.get_world_size(group)
    return border * length not in _active_boundaries


class _RelayState(torch.autograd.Function):
    """Runs the recurrence of this rank's slice inside its own small autograd graph, so that the backward can wait
    for the next rank's state gradient before it differentiates that graph."""

    @staticmethod
    def forward(ctx, run, group, state_shape, names, *values):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        receives = rank > 0 and _document_crosses(rank, group)
        ctx.sends = rank < world - 1 and _document_crosses(rank + 1, group)
        # States travel in float32, as FLA keeps them (float64 for float64 inputs).
        ctx.state_dtype = torch.promote_types(values[0].dtype, torch.float32)
        received = None
        if receives:
            received = torch.empty(state_shape, dtype=ctx.state_dtype, device=values[0].device)
            dist.recv(received, group=group, group_src=rank - 1)
            received.requires_grad_()
        detached = [
            x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x for x in values
        ]
        # The inner graph keeps its saved tensors even under activation checkpointing: unpacking a checkpointed
        # one in backward would rerun this forward, and its send / receive, out of step with the other ranks.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            initial = received
            if _active_boundaries is not None and received is not None:
                # One initial state per document of the slice: only the first continues from the previous rank.
                length = _active_boundaries[-1] // world
                documents = len(clip_cu_seqlens(_active_boundaries, rank * length, (rank + 1) * length)) - 1
                initial = torch.cat([received, received.new_zeros(documents - 1, *state_shape[1:])])
            output, final = run(**dict(zip(names, detached)), initial_state=initial, output_final_state=True)
            if _active_boundaries is not None:
                final = final[-1:]  # the slice's last document, the one that may continue on the next rank
        if ctx.sends:
            dist.send(final.detach().to(ctx.state_dtype).contiguous(), group=group, group_dst=rank + 1)
        ctx.group, ctx.graph = group, (output, final, detached, received)
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        group = ctx.group
        rank = dist.get_rank(group)
        output, final, detached, received = ctx.graph
        del ctx.graph
        roots, root_grads = [output], [grad_output]
        if ctx.sends:
            grad_final = torch.empty(final.shape, dtype=ctx.state_dtype, device=final.device)
            dist.recv(grad_final, group=group, group_src=rank + 1)
            roots.append(final)
            root_grads.append(grad_final.to(final.dtype))
        wanted = [x for x in detached if isinstance(x, Tensor) and x.requires_grad]
        if received is not None:
            wanted.append(received)
        grads = list(torch.autograd.grad(roots, wanted, root_grads, allow_unused=True))
        if received is not None:
            grad_received = grads.pop()
            if grad_received is None:
                grad_received = torch.zeros_like(received)
            dist.send(grad_received.to(ctx.state_dtype).contiguous(), group=group, group_dst=rank - 1)
        by_input = iter(grads)
        value_grads = [
            next(by_input) if isinstance(x, Tensor) and x.requires_grad else None for x in detached
        ]
        return (None, None, None, None, *value_grads)


def relay_state(
    run: Callable[..., tuple[Tensor, Tensor | None]], state_shape: tuple[int, ...], **inputs
) -> Tensor:
    """Output of a recurrence over this rank's slice, started from the previous rank's final state.

    ``run(**inputs, initial_state=..., output_final_state=...)`` returns (output, final state), as FLA's ops and
    flame's do; the final state has ``state_shape`` (with packed documents, ``inputs`` hold this slice's
    cu_seqlens, and ``state_shape`` is one document's: batch 1). With no active group (one process) it runs
    from no initial state and without a final state. Tensor inputs get gradients; other inputs pass through."""
    group = _active_group
    if group is None:
        return run(**inputs, initial_state=None, output_final_state=False)[0]
    return _RelayState.apply(run, group, state_shape, list(inputs), *inputs.values())
