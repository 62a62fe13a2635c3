"""Shared helpers for the model tests: tiny models and the packed-documents (varlen) comparison."""

from itertools import accumulate

import torch

from flame.models import build_model, get_model_spec

# Small enough for CPU, big enough for two heads of each kind and a chunk boundary at 64 tokens.
TINY = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2}


def tiny_args(model_type: str, **overrides):
    args, unknown = get_model_spec(model_type).args_cls.from_dict({**TINY, **overrides})
    assert unknown == []
    return args


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = build_model(tiny_args(model_type, **overrides))
    model.init_weights()
    return model.to(dtype)


def packed_and_alone(forward, documents: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``forward(x, position_ids, cu_seqlens)`` once on the documents packed into one row (batch 1, positions
    restarting per document) and once per document; returns both outputs over the packed tokens."""
    lengths = [doc.shape[1] for doc in documents]
    cu_seqlens = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = forward(torch.cat(documents, dim=1), position_ids, cu_seqlens)
    alone = torch.cat([forward(doc, torch.arange(doc.shape[1])[None], None) for doc in documents], dim=1)
    return packed, alone
