"""Helpers for packed variable-length batches described by `cu_seqlens`.

As in FlashAttention and FLA, a packed batch has batch size 1 and `cu_seqlens` = [0, len_0, len_0 + len_1, ...]
(int32 or int64, N + 1 entries for N documents). The recurrent PyTorch implementations turn such a batch into a
zero-padded batch of N documents, run the batched code, and gather the real tokens back, so that no state crosses a
document boundary by construction; the short convolution and attention mask by document ids / positions instead.
"""

import torch


def document_ids_and_positions(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed token: the index of its document and its position inside that document (int64, [T] each)."""
    cu_seqlens = cu_seqlens.long()
    lengths = cu_seqlens.diff()
    document_ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    positions = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - cu_seqlens[document_ids]
    return document_ids, positions


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position of each packed token inside its own document, [T] int64 (0 at every document start)."""
    return document_ids_and_positions(cu_seqlens)[1]


def pad_documents(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1, T, ...] packed -> [N, T_max, ...], each document left-aligned and followed by zeros."""
    if x.shape[0] != 1:
        raise ValueError(f"a packed batch (cu_seqlens given) must have batch size 1, got {x.shape[0]}")
    document_ids, positions = document_ids_and_positions(cu_seqlens)
    max_length = int(cu_seqlens.long().diff().max())
    padded = x.new_zeros(len(cu_seqlens) - 1, max_length, *x.shape[2:])
    return padded.index_put((document_ids, positions), x[0])


def unpad_documents(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of `pad_documents`: [N, T_max, ...] -> [1, T, ...]."""
    document_ids, positions = document_ids_and_positions(cu_seqlens)
    return x[document_ids, positions].unsqueeze(0)


def check_packed_batch(
    batch_size: int, cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None
) -> None:
    """FLA's argument checks for recurrent ops: batch size 1 with cu_seqlens, one initial state per sequence."""
    if cu_seqlens is None:
        num_sequences = batch_size
    elif batch_size != 1:
        raise ValueError(f"a packed batch (cu_seqlens given) must have batch size 1, got {batch_size}")
    else:
        num_sequences = len(cu_seqlens) - 1
    if initial_state is not None and initial_state.shape[0] != num_sequences:
        raise ValueError(
            f"expected one initial state per sequence ({num_sequences}), got {initial_state.shape[0]}"
        )
