"""Which implementation serves a call of an op: one table for every op that has more than one.

Each op registers, once, its PyTorch implementation (CPU tensors; also the reference every kernel is tested
against) and its CUDA backends by name, fastest first. A call on CUDA tensors runs the backend the job pinned
(``pin``; for attention, ``--model.attention_backend``), else the op's first backend; a call on any other device
runs the PyTorch implementation. An op marked ``eager_only`` runs its PyTorch code under torch.compile too, where
inductor fuses it with the code around it (a kernel call would split the compiled graph).

Adding a backend is one entry in its op's ``register_op`` call.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class Op:
    name: str
    torch_impl: Callable
    cuda_backends: Mapping[str, Callable]  # fastest first
    eager_only: bool = False
    pinned: str | None = field(default=None, init=False)

    def implementation(self, x: torch.Tensor) -> Callable:
        """What serves a call whose main input is ``x``."""
        if not x.is_cuda or (self.eager_only and torch.compiler.is_compiling()):
            return self.torch_impl
        return self.cuda_backends[self.pinned or next(iter(self.cuda_backends))]


_TABLE: dict[str, Op] = {}


def register_op(
    name: str, torch_impl: Callable, cuda_backends: Mapping[str, Callable], *, eager_only: bool = False
) -> Op:
    """Enter an op in the table (at the import of the module that defines it); returns its entry."""
    if name in _TABLE:
        raise ValueError(f"op {name!r} is registered already")
    if not cuda_backends:
        raise ValueError(f"op {name!r} needs at least one CUDA backend")
    _TABLE[name] = Op(name, torch_impl, dict(cuda_backends), eager_only)
    return _TABLE[name]


def backend_names(op: str) -> tuple[str, ...]:
    return tuple(_lookup(op).cuda_backends)


def pin(op: str, backend: str | None) -> None:
    """Serve ``op``'s CUDA calls with ``backend`` from now on in this process; None restores the default."""
    entry = _lookup(op)
    if backend is not None and backend not in entry.cuda_backends:
        raise ValueError(f"{op} backend must be one of {backend_names(op)}, got {backend!r}")
    entry.pinned = backend


def pinned(op: str) -> str:
    """The backend that serves ``op``'s CUDA calls now."""
    entry = _lookup(op)
    return entry.pinned or next(iter(entry.cuda_backends))


def _lookup(op: str) -> Op:
    if op not in _TABLE:
        raise KeyError(f"no op {op!r} in the dispatch table; registered: {', '.join(sorted(_TABLE))}")
    return _TABLE[op]
