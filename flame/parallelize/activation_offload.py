"""Activation offloading per block (``--activation_offload.mode full``, upstream flame's option): what a block's
forward saves for backward waits in host memory instead of on the GPU.

Each block's forward runs inside ``torch.autograd.graph.saved_tensors_hooks``. A saved tensor is copied into
pinned host memory on a side CUDA stream while the forward goes on (the caching allocator keeps its device memory
until the copy has run, then frees it once autograd drops it); the backward copies a block's tensors back on the
same stream when it first needs one of them, and at once starts copying the block before it (the next in backward
order), so that the copies of one block overlap the computation of another and about two blocks' activations are on
the device at a time. The host waits when it runs more than BLOCKS_AHEAD blocks ahead of the copies in forward or
of the GPU in backward: memory freed behind a pending copy or fetched ahead of the GPU is still allocated. Small tensors (below ``min_bytes``) and the storage of the block's parameters (FSDP2's
gathered weights, which it frees and gathers again itself) stay where they are; a tensor saved by several ops of a
block is copied once.

Host memory: before the offloaded tensors grow past their share of what the host had free (MemAvailable less
HOST_RESERVE_BYTES, divided among the host's ranks, LOCAL_WORLD_SIZE) when it was last measured, the host is
measured again, and a step that would take more stops with one line
(HostMemoryExhausted) instead of the kernel's out-of-memory killer ending the process without one. Pinned memory
freed in backward stays in the CUDA host allocator's cache for the next step, which reuses it: the check bounds the
first step's high-water mark. That allocator rounds each allocation up to a power of two (torch's
CachingHostAllocator.h; its ``pinned_max_round_threshold`` is unbounded by default), which would cost up to twice the
tensor's bytes (a 65,536 x 1,536 bf16 tensor, 192 MiB, would take 256): a tensor is stored in pieces of
``piece_bytes`` (a power of two, so not rounded) and one last piece, under one piece lost per tensor, and the bytes
the allocator takes are what the check counts (rounded whole, GatedDeltaNet 340M's 65,536-token step outgrew an
H100 machine's 125 GiB; in pieces it fits, docs/performance.md).

Composition: the hooks wrap the outermost module of each block, so with activation checkpointing they see what
the checkpoint saves, which is the block's input (full AC: the input is offloaded, the recomputation in backward
runs on the device; per-op selective AC: the ops' outputs it keeps stay on the device, as the checkpoint stores them
itself), and with per-block torch.compile they run outside the compiled graph, around it (the graph's saved tensors
are offloaded). FSDP2's hooks run before them in forward and backward (the gather before the block's hooks).

Without a GPU a saved tensor is cloned in host memory: the same round trip, nothing saved, numerically the
identity.
"""

import collections
import os
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torchtitan.tools.logging import logger

from flame.errors import FlameError
from flame.models import model_spec

# Below this a copy costs more in launches than it saves in memory (norm statistics, gates of one scalar per head).
MIN_OFFLOAD_BYTES = 1 << 16
# How many blocks the host may run ahead of the copies (forward) or of the GPU's backward: memory that waits for a
# copy, or a fetched copy, counts as allocated until the GPU gets there, so an unbounded lead would keep every
# block's activations on the device after all.
BLOCKS_AHEAD = 2
# Host memory left to the rest of the job (the data loader, compile workers, the ranks' other buffers) when the
# offloaded activations are measured against what the host has free.
HOST_RESERVE_BYTES = 4 << 30
# The size of the pinned pieces a saved tensor is stored in: a power of two (the host allocator keeps it as it is
# and reuses it for any piece of the next step), large enough that one copy moves at the link's speed.
PIECE_BYTES = 1 << 24
GIB = 1 << 30


class HostMemoryExhausted(FlameError):
    """The offloaded activations of a step would need more host memory than the machine has free."""


def available_host_bytes() -> float:
    """The host memory the kernel can give without swapping (/proc/meminfo's MemAvailable); unbounded where it
    does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def host_bytes(size: int, piece_bytes: int, pinned: bool) -> int:
    """The host memory a tensor of ``size`` bytes takes in pieces of ``piece_bytes``: the last piece rounded up to a
    power of two where it is pinned (the CUDA host allocator's rounding)."""
    whole, last = divmod(size, piece_bytes)
    if last and pinned:
        last = 1 << (last - 1).bit_length()
    return whole * piece_bytes + last


def memory_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """The bytes of a dense tensor (one without gaps or overlaps, in any dimension order) in memory order, as a
    view; None for any other (an expanded view, a tensor subclass, a sparse layout)."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return None
    if torch.empty_like(tensor, device="meta").stride() != tensor.stride():
        return None  # empty_like keeps the strides of exactly the dense tensors
    return tensor.detach().as_strided((tensor.numel(),), (1,)).view(torch.uint8)


class _Stash:
    """One saved tensor in host memory (its bytes in pieces), and its copy back on the device once fetched."""

    __slots__ = ("group", "pieces", "shape", "stride", "dtype", "device", "__weakref__")

    def __init__(self, group: "_BlockForward", pieces: list[torch.Tensor], like: torch.Tensor):
        self.group = group
        self.pieces = pieces
        self.shape, self.stride, self.dtype = like.shape, like.stride(), like.dtype
        self.device: torch.Tensor | None = None

    def restore(self, device: torch.device) -> torch.Tensor:
        """The tensor again on ``device`` (asynchronous on a CUDA stream from pinned pieces)."""
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        data, start = memory_bytes(tensor), 0
        for piece in self.pieces:
            data[start : start + piece.numel()].copy_(piece, non_blocking=True)
            start += piece.numel()
        return tensor


class _BlockForward:
    """The tensors one forward of one block offloaded (weakly: autograd's saved variables own them), and the block
    whose forward ran just before it in the same pass (the next one backward needs)."""

    def __init__(self, offload: "ActivationOffload", index: int, previous: "_BlockForward | None"):
        self.offload = offload
        self.index = index
        self.previous = weakref.ref(previous) if previous is not None else None
        self.stashes: list[weakref.ref[_Stash]] = []
        # During forward: one copy of a tensor saved by several ops. The tensor is held until the block's forward
        # ends, so that its memory cannot go to a new tensor with the same key in the meantime.
        self.by_key: dict[tuple, tuple[torch.Tensor, _Stash]] = {}
        self.fetched = False
        self.in_backward = False  # backward has asked for one of its tensors
        self.copied_back: torch.cuda.Event | None = None  # recorded on the side stream after the copies back

    def fetch(self) -> None:
        """Start copying every live stash back to the device (on the side stream; the host copy itself without
        a GPU)."""
        if self.fetched:
            return
        self.fetched = True
        live = [stash for ref in self.stashes if (stash := ref()) is not None]
        stream = self.offload.stream
        if stream is None:
            for stash in live:
                stash.device = stash.restore(self.offload.device)
            return
        with torch.cuda.stream(stream):
            for stash in live:
                stash.device = stash.restore(self.offload.device)
            self.copied_back = torch.cuda.Event()
            self.copied_back.record(stream)


class ActivationOffload:
    """The pack/unpack hooks of every block of a model (one instance per model)."""

    def __init__(
        self, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES, piece_bytes: int = PIECE_BYTES
    ):
        self.device = device
        self.min_bytes = min_bytes
        self.piece_bytes = piece_bytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last: _BlockForward | None = None  # the block forward that ran last
        # CUDA events: copies of the last blocks' forwards done; the GPU reached the last blocks' backwards.
        self.copied = collections.deque(maxlen=BLOCKS_AHEAD)
        self.reached = collections.deque(maxlen=BLOCKS_AHEAD)
        self.current: _BlockForward | None = None
        self.parameter_storages: set[int] = set()
        self.offloaded_bytes = 0  # the saved tensors' bytes copied to the host so far
        self.live_bytes = 0  # host memory the stored pieces take now
        self.peak_live_bytes = 0  # the most they took at once (a step's high-water mark)
        self.host_budget = 0.0  # what live_bytes may reach before the host's free memory is measured again
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def enter(self, block: nn.Module, index: int) -> None:
        if len(self.copied) == BLOCKS_AHEAD:
            self.copied[0].synchronize()
        previous = self.last if self.last is not None and self.last.index == index - 1 else None
        self.current = _BlockForward(self, index, previous)
        # Read at each forward: FSDP2 swaps in gathered parameters before the block runs.
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
        self.hooks.__enter__()

    def exit(self) -> None:
        self.hooks.__exit__(None, None, None)
        if self.stream is not None and self.current.stashes:
            self.copied.append(self.stream.record_event())
        self.current.by_key.clear()
        self.last, self.current = self.current, None

    def pack(self, tensor: torch.Tensor):
        group = self.current
        if (
            traced(tensor)
            or tensor.numel() * tensor.element_size() < self.min_bytes
            or tensor.untyped_storage().data_ptr() in self.parameter_storages
            or tensor.device.type != self.device.type
        ):
            return tensor
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor._version,
        )
        if (seen := group.by_key.get(key)) is not None:
            return seen[1]
        data = memory_bytes(tensor)
        if data is None:
            return tensor  # not dense: its bytes do not make the tensor again
        pinned = self.stream is not None
        size = host_bytes(data.numel(), self.piece_bytes, pinned)
        if self.live_bytes + size > self.host_budget:
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the host's ranks offload at once
            self.host_budget = self.live_bytes + (available_host_bytes() - HOST_RESERVE_BYTES) / ranks
            if self.live_bytes + size > self.host_budget:
                raise HostMemoryExhausted(
                    f"activation offloading needs more host memory than this machine has free: "
                    f"{(self.live_bytes + size) / GIB:.1f} GiB of this step's activations (this rank's, of {ranks}"
                    f" on the host) would leave less than {HOST_RESERVE_BYTES / GIB:.0f} GiB to the rest of the job; "
                    "train with "
                    "--activation_checkpoint.mode full instead (it recomputes them), a shorter --training.seq_len, or "
                    "on a host with more memory"
                )
        if pinned:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        pieces = []
        with torch.cuda.stream(self.stream):  # no stream (no GPU): a no-op
            for start in range(0, data.numel(), self.piece_bytes):
                piece = data[start : start + self.piece_bytes]
                pieces.append(
                    torch.empty_like(piece, device="cpu", pin_memory=pinned).copy_(piece, non_blocking=pinned)
                )
        if pinned:
            tensor.record_stream(self.stream)  # its memory is not reused before the copies have read it
        self.offloaded_bytes += data.numel()
        self.live_bytes += size
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        stash = _Stash(group, pieces, tensor)
        weakref.finalize(stash, self.released, size)  # autograd dropped the saved tensor
        group.stashes.append(weakref.ref(stash))
        group.by_key[key] = (tensor, stash)
        return stash

    def released(self, size: int) -> None:
        self.live_bytes -= size

    def unpack(self, packed):
        if not isinstance(packed, _Stash):
            return packed
        group = packed.group
        if not group.in_backward:
            group.in_backward = True
            if self.stream is not None:
                if len(self.reached) == BLOCKS_AHEAD:
                    self.reached[0].synchronize()
                self.reached.append(torch.cuda.current_stream(self.device).record_event())
        group.fetch()
        if group.previous is not None and (previous := group.previous()) is not None:
            previous.fetch()  # overlaps with this block's backward
        if self.stream is None:
            return packed.device
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(group.copied_back)
        packed.device.record_stream(compute)  # allocated on the side stream, used and freed on this one
        return packed.device


def traced(tensor: torch.Tensor) -> bool:
    """A tensor of a compiler's trace: AOTAutograd runs the ambient hooks when an op it traces saves a tensor in
    Python (a custom op's autograd), and a copy or ``record_stream`` there fails to functionalize (seen on an H200
    with torch 2.11: compiled attention blocks with varlen batches). The compiled block's own saved tensors go
    through the hooks at run time."""
    return torch.compiler.is_compiling() or isinstance(tensor, (FakeTensor, FunctionalTensor))


def apply_activation_offload(
    model: nn.Module, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES, piece_bytes: int = PIECE_BYTES
) -> ActivationOffload:
    """Offload the saved tensors of each block of ``model`` (its outermost module: after activation checkpointing
    and compile wrapped it, before FSDP shards it); the hooks' state is ``model.activation_offload``, where the
    trainer and the bench read the host memory it took (``host_peak_gib``)."""
    offload = ActivationOffload(device, min_bytes, piece_bytes)
    model.activation_offload = offload
    index = 0
    for stack in model_spec(model.args).blocks(model):
        for block in stack.children():
            block.register_forward_pre_hook(lambda module, args, i=index: offload.enter(module, i))
            block.register_forward_hook(lambda module, args, output: offload.exit(), always_call=True)
            index += 1
    if device.type == "cuda":
        logger.info("Offloading the activations of %d blocks to pinned host memory", index)
    else:
        logger.info(
            "activation_offload.mode full without a GPU: saved tensors are copied in host memory (no gain)"
        )
    return offload


def host_peak_gib(modules) -> float | None:
    """The host memory the offloaded activations of ``modules`` (a model's parts) took at their peak, in GiB;
    None where none offloads."""
    offloads = [offload for module in modules if (offload := getattr(module, "activation_offload", None))]
    return sum(offload.peak_live_bytes for offload in offloads) / GIB if offloads else None
