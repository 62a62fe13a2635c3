"""flame.ops.context_parallel on 3 gloo ranks: each exchange, forward and backward, equals the single-process
computation on the whole sequence (float64, odd sizes; 1e-12 relative), also on packed documents (the short
convolution, the state relay and attention across slice borders); with no active group every function is the
single-process one."""

import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flame.models.layers.short_conv import ShortConvolution
from flame.ops.attention import attention
from flame.ops.context_parallel import (
    active_group,
    clip_cu_seqlens,
    gather_prefix,
    prefix_attention,
    previous_tokens,
    relay_state,
    sequence_sharded,
    shard_sequence,
)

WORLD, BATCH, SLICE, WIDTH = 3, 2, 5, 7  # 15 positions, 7 channels
ATTEND = functools.partial(attention, impl="softmax", causal=True)
TOL = 1e-12
CONV_SIZE = 3  # the convolution reads the 2 tokens before each slice
# Packed rows (the batch's first row) against the borders 5 and 10: documents that start inside the 2 tokens
# before a border, a document over all three slices, documents of 1 token; documents starting on both borders.
PACKED = {"packed_three_slices": (0, 1, 4, 14, 15), "packed_on_borders": (0, 4, 5, 6, 10, 15)}


def decayed_sum(x, decay, initial_state=None, output_final_state=False):
    """A recurrence with a state: h_t = decay_t * h_{t-1} + x_t, output h_t; x [B, T, D], decay [B, T, 1]."""
    state = torch.zeros_like(x[:, 0]) if initial_state is None else initial_state.to(x.dtype)
    outputs = []
    for t in range(x.shape[1]):
        state = decay[:, t] * state + x[:, t]
        outputs.append(state)
    return torch.stack(outputs, 1), (state if output_final_state else None)


def decayed_sum_packed(x, decay, cu_seqlens, initial_state=None, output_final_state=False):
    """decayed_sum restarted at every document of a packed row x [1, T, D]; states [N documents, D]."""
    outputs, finals = [], []
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = None if initial_state is None else initial_state[i : i + 1]
        out, final = decayed_sum(x[:, start:end], decay[:, start:end], state, output_final_state=True)
        outputs.append(out)
        finals.append(final)
    return torch.cat(outputs, 1), (torch.cat(finals) if output_final_state else None)


def short_convolution():
    torch.manual_seed(0)
    return ShortConvolution(WIDTH, CONV_SIZE).double()


def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, WORLD * SLICE, WIDTH, dtype=torch.float64, generator=g)
    decay = torch.rand(BATCH, WORLD * SLICE, 1, dtype=torch.float64, generator=g)
    upstream = torch.randn(BATCH, WORLD * SLICE, WIDTH, dtype=torch.float64, generator=g)
    return x, decay, upstream


def attention_inputs():
    """q (4 heads), k, v (2 heads; head dims 3 and 5) and the attention output's upstream gradient, one row."""
    g = torch.Generator().manual_seed(1)
    shapes = [(4, 3), (2, 3), (2, 5), (4, 5)]
    return [torch.randn(1, WORLD * SLICE, h, d, dtype=torch.float64, generator=g) for h, d in shapes]


def whole_sequence():
    """Single-process results: gathered prefixes, previous tokens and the recurrence, with their gradients."""
    x, decay, upstream = inputs()
    results = {}
    for name in ("prefix", "previous", "relay"):
        x_ = x.clone().requires_grad_()
        decay_ = decay.clone().requires_grad_()
        if name == "prefix":  # what each rank's slice of keys sees: positions [0, (r + 1) L)
            out = torch.cat([(x_[:, : (r + 1) * SLICE] * upstream[:, r * SLICE : (r + 1) * SLICE].sum(1, keepdim=True)).sum(1) for r in range(WORLD)], 1)  # fmt: skip
        elif name == "previous":  # the 2 tokens before each slice
            padded = torch.cat([torch.zeros_like(x_[:, :2]), x_], 1)
            out = torch.cat([padded[:, r * SLICE : r * SLICE + 2] for r in range(WORLD)], 1) * upstream[:, :6]
        else:
            out = decayed_sum(x_, decay_)[0] * upstream
        out.sum().backward()
        results[name] = (out.detach(), x_.grad, decay_.grad)
    for name, documents in PACKED.items():
        cu_seqlens = torch.tensor(documents, dtype=torch.int32)
        x_ = x[:1].clone().requires_grad_()
        decay_ = decay[:1].clone().requires_grad_()
        *qkv, attended_upstream = attention_inputs()
        q, k, v = (t.requires_grad_() for t in qkv)
        conv = short_convolution()(x_, cu_seqlens) * upstream[:1]
        relay = decayed_sum_packed(x_, decay_, cu_seqlens)[0] * upstream[:1]
        attended = ATTEND(q, k, v, cu_seqlens=cu_seqlens) * attended_upstream
        (conv.sum() + relay.sum() + attended.sum()).backward()
        results[name] = (conv.detach(), relay.detach(), attended.detach(), x_.grad, decay_.grad, q.grad, k.grad,
                         v.grad)  # fmt: skip
    return results


def per_rank(rank: int):
    x, decay, upstream = inputs()
    group = dist.group.WORLD
    results = {}
    for name in ("prefix", "previous", "relay"):
        x_ = shard_sequence(x, group).clone().requires_grad_()
        decay_ = shard_sequence(decay, group).clone().requires_grad_()
        up = shard_sequence(upstream, group)
        with sequence_sharded(group):
            assert active_group() is group
            if name == "prefix":
                out = (gather_prefix(x_) * up.sum(1, keepdim=True)).sum(1)
            elif name == "previous":
                out = previous_tokens(x_, 2) * upstream[:, 2 * rank : 2 * rank + 2]
            else:
                out = relay_state(decayed_sum, (BATCH, WIDTH), x=x_, decay=decay_) * up
            out.sum().backward()
        results[name] = (out.detach(), x_.grad, decay_.grad)
    for name, documents in PACKED.items():
        cu_seqlens = torch.tensor(documents, dtype=torch.int32)
        # What the trainer's shard_batch gives the model: the documents of this rank's slice.
        local = torch.tensor(clip_cu_seqlens(documents, rank * SLICE, (rank + 1) * SLICE), dtype=torch.int32)
        x_ = shard_sequence(x[:1], group).clone().requires_grad_()
        decay_ = shard_sequence(decay[:1], group).clone().requires_grad_()
        up = shard_sequence(upstream[:1], group)
        *qkv, attended_upstream = (shard_sequence(t, group) for t in attention_inputs())
        q, k, v = (t.clone().requires_grad_() for t in qkv)
        with sequence_sharded(group, cu_seqlens):
            conv = short_convolution()(x_, local) * up
            relay = relay_state(decayed_sum_packed, (1, WIDTH), x=x_, decay=decay_, cu_seqlens=local) * up
            attended = prefix_attention(q, k, v, local, ATTEND) * attended_upstream
            (conv.sum() + relay.sum() + attended.sum()).backward()
        results[name] = (conv.detach(), relay.detach(), attended.detach(), x_.grad, decay_.grad, q.grad, k.grad,
                         v.grad)  # fmt: skip
    return results


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # NumPy copies: a tensor would travel as shared memory that dies with this process.
        queue.put(
            (
                rank,
                {name: [None if t is None else t.numpy() for t in ts] for name, ts in per_rank(rank).items()},
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(port, queue), nprocs=WORLD, join=True, start_method="spawn")
    found = dict(queue.get() for _ in range(WORLD))
    return [
        {
            name: [None if a is None else torch.from_numpy(a) for a in arrays]
            for name, arrays in found[r].items()
        }
        for r in range(WORLD)
    ]


def assert_close(got, want):
    assert torch.allclose(got, want, rtol=TOL, atol=TOL), (got - want).abs().max()


@pytest.mark.parametrize("name", ["prefix", "previous", "relay"])
def test_exchange_equals_the_whole_sequence(ranks, name):
    want_out, want_dx, want_ddecay = whole_sequence()[name]
    out = torch.cat([r[name][0] for r in ranks], 1)
    assert_close(out, want_out)
    # Each rank's input gradient is its slice of the whole sequence's (the prefix's and the previous tokens'
    # gradients reach the ranks that own those positions).
    assert_close(torch.cat([r[name][1] for r in ranks], 1), want_dx)
    if name == "relay":
        assert_close(torch.cat([r[name][2] for r in ranks], 1), want_ddecay)


@pytest.mark.parametrize("name", list(PACKED))
def test_short_convolution_relay_and_attention_on_packed_documents_equal_the_whole_row(ranks, name):
    """Each rank convolves its slice with the previous rank's tokens of the same document only, starts its first
    document from the previous rank's state only when that document began there, and its queries attend to the
    earlier ranks' keys of their own document only."""
    want = whole_sequence()[name]
    for i, expected in enumerate(want):
        assert_close(torch.cat([r[name][i] for r in ranks], 1), expected)


def test_clip_cu_seqlens():
    documents = [0, 1, 4, 14, 15]
    assert clip_cu_seqlens(documents, 0, 5) == [0, 1, 4, 5]
    assert clip_cu_seqlens(documents, 5, 10) == [0, 5]  # inside one document
    assert clip_cu_seqlens(documents, 10, 15) == [0, 4, 5]
    # A short convolution's window on ranks 1 and 0: the 2 tokens before the slice, then the slice; on rank 0
    # the zeros before the row are a document of their own.
    assert clip_cu_seqlens(documents, 3, 10) == [0, 1, 7]
    assert clip_cu_seqlens(documents, -2, 5) == [0, 2, 3, 6, 7]
    # Boundaries on the borders start the slices' first documents, and are not repeated.
    assert clip_cu_seqlens([0, 4, 5, 6, 10, 15], 5, 10) == [0, 1, 5]
    assert clip_cu_seqlens([0, 4, 5, 6, 10, 15], 8, 15) == [0, 2, 7]


def test_no_active_group_is_one_process():
    x, decay, _ = inputs()
    assert active_group() is None
    assert gather_prefix(x) is x
    assert previous_tokens(x, 2) is None
    assert torch.equal(relay_state(decayed_sum, (BATCH, WIDTH), x=x, decay=decay), decayed_sum(x, decay)[0])
