"""Observers of attention calls: diagnostics see the queries and keys every attention layer scores.

    with observe_attention(fn):
        model(tokens)          # fn(q, k, impl=..., causal=..., window_size=..., cu_seqlens=..., scale=...) per call

Observers are called in call order (for a decoder, layer order), with the tensors the kernel receives (after RoPE,
QK-norm and query scaling). With no observer registered, `notify_observers` is one empty-list check.
"""

import contextlib
from collections.abc import Callable, Iterator

import torch

_observers: list[Callable[..., None]] = []


@contextlib.contextmanager
def observe_attention(fn: Callable[..., None]) -> Iterator[None]:
    """Hand fn every attention call made inside the context (contexts nest: observers run in the order they were
    entered); fn is removed when the context ends, also by an exception. See flame.diagnostics.attention."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


def notify_observers(q: torch.Tensor, k: torch.Tensor, **attention_args) -> None:
    for fn in _observers:
        fn(q, k, **attention_args)
