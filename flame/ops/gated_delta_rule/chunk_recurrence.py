"""What flame's sequential chunk recurrences (fwd_h_triton.py, the state recurrence; fwd_o_triton.py, the state
recurrence with the output; dhu_triton.py, the state recurrence's backward) share: in Triton, a program's sequence
bounds and its [K, BV] tile of a state; on the host, the chunk layout of a call, the key block, the GPU's shared
memory, the test of whether a kernel takes a call, and how a kernel is tuned and launched.

Each carries one [K, BV] slice of a state per program through a sequence's chunks, so that a program needs the
whole key width in one tile: K up to 256, the largest FLA's kernels take.
"""

import functools

import torch
import triton
import triton.language as tl

MAX_KEY_DIM = 256


@triton.jit
def sequence_bounds(cu_seqlens, chunk_offsets, i_n, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first token, length, first chunk in the flat chunk order) of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n * T
        length = T
        boh = i_n * tl.cdiv(T, BT)
    return bos, length, boh


@triton.jit
def state_tile(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               STATE_V_FIRST: tl.constexpr):  # fmt: skip
    """Key and value offsets and masks of value block i_v's [BK, BV] tile, and its offsets in a [K, V] state (or a
    [V, K] one with STATE_V_FIRST)."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if STATE_V_FIRST:
        p_kv = o_k[:, None] + o_v[None, :] * K
    else:
        p_kv = o_k[:, None] * V + o_v[None, :]
    return o_k, m_k, o_v, m_v, m_k[:, None] & m_v[None, :], p_kv


def key_block(key_dim: int) -> int:
    return max(16, triton.next_power_of_2(key_dim))


@functools.cache
def shared_memory_limit(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def chunk_layout(
    batch: int,
    seq_len: int,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
) -> tuple[int, torch.Tensor | None, int, int]:
    """(sequences, each sequence's first chunk in the flat order (varlen only), chunks per row, rows) in FLA's
    layout of chunk states: [B, chunks per row] or, packed (cu_seqlens int64 on the device), [1, all chunks].
    FLA's chunk_indices ([chunks, 2]) give the chunk count under varlen without a host sync."""
    if cu_seqlens is None:
        return batch, None, triton.cdiv(seq_len, chunk_size), batch
    per_sequence = (cu_seqlens.diff() + chunk_size - 1) // chunk_size
    chunks = chunk_indices.shape[0] if chunk_indices is not None else int(per_sequence.sum())
    return cu_seqlens.numel() - 1, per_sequence.cumsum(0) - per_sequence, chunks, 1


def takes(x: torch.Tensor, chunk_size: int, state_v_first: bool, fitting_configs) -> bool:
    """Whether a recurrence kernel takes this call in training: bf16 inputs and value-first states (Gated DeltaNet's
    layer), where bench/recurrences.py measured flame's kernels faster than FLA's and the GPU tests check them
    against FLA's, on a CUDA device where one of the kernel's settings (``fitting_configs``) fits."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and state_v_first
        and x.shape[-1] <= MAX_KEY_DIM
        and bool(
            fitting_configs(key_block(x.shape[-1]), chunk_size, 2, True, shared_memory_limit(x.device.index))
        )
    )


def check_call(name: str, fla_function: str, x: torch.Tensor, chunk_size: int, state_v_first: bool,
               fitting_configs, launch: dict | None) -> None:  # fmt: skip
    """One clear error for a call the kernel cannot take: keys wider than its tile, or (autotuned) no setting whose
    tiles fit the GPU's shared memory."""
    key_dim = x.shape[-1]
    if key_dim > MAX_KEY_DIM:
        raise ValueError(f"the {name} holds a [K, value block] tile: K = {key_dim} is over {MAX_KEY_DIM}")
    if launch is None and not fitting_configs(
        key_block(key_dim), chunk_size, x.element_size(), state_v_first, shared_memory_limit(x.device.index)
    ):
        raise ValueError(
            f"no launch setting of flame's {name} fits {x.dtype} inputs with K = {key_dim} in this GPU's shared "
            f"memory: use FLA's {fla_function} for this call"
        )


def fitting(configs: list[triton.Config], shared_memory_bytes, key_block: int, chunk_size: int, element_size: int,
            state_v_first: bool, limit: int) -> list[triton.Config]:  # fmt: skip
    """The settings whose bound on shared memory (``shared_memory_bytes``, the kernel's) is within ``limit``."""
    return [
        c
        for c in configs
        if shared_memory_bytes(c, key_block, chunk_size, element_size, state_v_first) <= limit
    ]


def pruner(fitting_configs, tensor: str):
    """The autotuner's pruning of the settings by ``fitting_configs``, for the kernel's argument ``tensor``."""

    def prune(configs, named_args, **meta):
        x = named_args[tensor]
        limit = shared_memory_limit(x.device.index)
        return fitting_configs(meta["BK"], meta["BT"], x.element_size(), meta["STATE_V_FIRST"], limit)

    return prune


# What a recurrence's tuning result depends on (the shipped bundle stores results under this key).
TUNING_KEY = ["H", "HV", "K", "V", "BT", "USE_G", "STATE_V_FIRST", "PRECISION"]


def autotuned(
    kernel, configs: list[triton.Config], fitting_configs, tensor: str, more_key: tuple[str, ...] = ()
):
    """``kernel`` tuned over ``configs``, those that do not fit (``fitting_configs``, for the kernel's argument
    ``tensor``) pruned before compiling; ``more_key``: the kernel's own arguments its result also depends on."""
    return triton.autotune(
        configs,
        key=[*TUNING_KEY, *more_key],
        prune_configs_by={"early_config_prune": pruner(fitting_configs, tensor)},
    )(kernel)


def launch_recurrence(kernel, tuned, launch: dict | None, value_dim: int, programs: int, args, meta) -> None:
    """One program per value block (BV wide) and each of ``programs`` (sequence x value head): ``tuned`` chooses
    the setting, or ``kernel`` runs the one ``launch`` fixes."""
    if launch is None:
        tuned[lambda chosen: (triton.cdiv(value_dim, chosen["BV"]), programs)](*args, **meta)
    else:
        kernel[(triton.cdiv(value_dim, launch["BV"]), programs)](*args, **meta, **launch)
