"""FlashQLA (`flash-qla`, the Qwen team's fused TileLang forward and backward of the gated delta rule) as a CUDA
backend of `chunk_gated_delta_rule`, for the calls it takes.

On one H100 it ran a Gated DeltaNet op with 16 heads of K = V = 128 in 1.61 ms against 2.85 ms for FLA's Triton
path (forward + backward, bf16, 8 x 2048 tokens, through FLA 0.6.0's own FlashQLA dispatch, 2026-11-24). Its
limits, which `refuses` states per call (FLA 0.6.0's own FlashQLA backend checks the same): Hopper or datacenter
Blackwell (SM90, SM100, SM103; SM120 has a forward only), bfloat16 or float16 q/k/v of one dtype, K = V = 128, no
negative eigenvalues, no context parallelism across GPUs, and nvcc for TileLang to compile with. The decay gate
and the sigmoid of beta, which FLA's Triton kernel can fuse (`use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`),
are computed here before the call, as FLA's layers did before 0.6.0. FlashQLA is not traced by torch.compile: a
compiled block breaks its graph around the call.
"""

import functools
import os
import shutil

import torch

from flame.ops.dispatch import not_traced
from flame.ops.gated_delta_rule.gate import gdn_gate

# Compute capabilities whose FlashQLA kernels run forward and backward.
CAPABILITIES = ((9, 0), (10, 0), (10, 3))


def device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def nvcc_found() -> bool:
    """TileLang compiles FlashQLA's kernels with nvcc at their first call: on PATH, or under CUDA_HOME (default
    /usr/local/cuda, where the GPU machines keep it). Looked up once: the refusal runs on every call."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.access(os.path.join(cuda_home, "bin", "nvcc"), os.X_OK)


def flash_qla_refuses(q, k, v, g, beta, *, allow_neg_eigval=False, cp_context=None, **kwargs) -> str | None:
    """Why FlashQLA cannot serve this call of `chunk_gated_delta_rule` (whose dispatcher passes everything after
    beta by keyword), or None. The checks of the call's own arguments come first: a compiled block traces this
    function, and they decide the calls FlashQLA cannot take without asking the device."""
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return "takes bfloat16 or float16 q, k and v of one dtype"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return f"takes K = V = 128 only, not K = {q.shape[-1]}, V = {v.shape[-1]}"
    if allow_neg_eigval:
        return "has no negative eigenvalues (allow_neg_eigval)"
    if cp_context is not None:
        return "has no context parallelism across GPUs"
    if device_capability(q.device) not in CAPABILITIES:
        return "runs on SM90, SM100 and SM103 GPUs only"
    if not nvcc_found():
        return "needs nvcc (on PATH or under CUDA_HOME) to compile its TileLang kernels"
    return None


@not_traced
def flash_qla_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    **fla_only,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlashQLA's op on the calls `flash_qla_refuses` lets through. Of FLA's other arguments (``fla_only``),
    allow_neg_eigval and cp_context are refused, FlashQLA keeps its own chunk size, and cu_seqlens_cpu and
    chunk_indices only save FLA work."""
    import flash_qla

    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid().to(beta.dtype)
    return flash_qla.chunk_gated_delta_rule(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        auto_cp=True,
    )
