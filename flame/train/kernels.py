"""A run's kernel choices, made before its model runs: the attention backend, whether the delta rules keep their
chunk states, and on a GPU Triton's tuning and the backends flame fixes in FLA. The ranks make them in
``model_parts.build_model_parts`` and the kernel prewarm (prewarm.py) makes the same ones, so that the kernels it
compiles are those the ranks call. Imports no torchtitan, so that the prewarm starts within seconds."""

import torch

from flame.compat import fla_tilelang_attention_takes_what_it_compiles
from flame.ops import dispatch
from flame.ops.attention import set_attention_backend
from flame.ops.autotune import tune_once_per_host, use_shipped_results
from flame.ops.fla_library import set_chunk_states


def choose_kernels(job_config, device: torch.device) -> None:
    """The job's attention backend and chunk-state policy, then ``prepare_gpu_kernels``; refuses a
    FLAME_BACKENDS_OFF that names no backend."""
    # Every op with backends in the table, so that each name FLAME_BACKENDS_OFF may give is there.
    import flame.ops.attention_delta
    import flame.ops.linear_cross_entropy
    import flame.ops.selective_scan
    import flame.ops.ssd  # noqa: F401

    dispatch.check_backends_off()
    set_attention_backend(job_config.model.attention_backend)
    set_chunk_states(chunk_states(job_config))
    prepare_gpu_kernels(device)


def prepare_gpu_kernels(device: torch.device) -> None:
    """On a GPU: Triton's kernels tuned once per host and seeded with flame's shipped results
    (flame.ops.autotune), and flame's gated chunk_bwd_dqkwg registered with FLA where FLA refuses its own (Hopper,
    FLA issue 640), so every model calling FLA's gated backward trains there: flame's GatedDeltaNet and FLA's
    comba, mom, precond_gated_deltanet, gated_deltanet alike; FLA's TileLang attention keeps to the head widths it
    compiles (flame.compat), the others going to FLA's Triton kernel."""
    if device.type != "cuda":
        return
    # Before any of flame's kernel modules is imported: an autotuner reads TRITON_CACHE_AUTOTUNING, which
    # tune_once_per_host sets, when it is made, and one made without it never reads or keeps a tuning result.
    tune_once_per_host()
    use_shipped_results(torch.cuda.get_device_name(device))
    from flame.ops.gated_delta_rule.dqkwg_triton import serve_where_fla_refuses  # imports Triton

    serve_where_fla_refuses()
    fla_tilelang_attention_takes_what_it_compiles()


def chunk_states(job_config) -> str:
    """--activation_checkpoint.chunk_states with auto resolved: the states are kept where the blocks replay as CUDA
    graphs, whose steps the GPU bounds (gated_deltanet_340M on an H200: 5.8% faster, docs/performance.md "Chunk
    states"); elsewhere the host issuing FLA's kernels bounded the step, and keeping them cost memory for no gain."""
    # Imported here: its torchtitan logger, imported before the job is parsed, would run torchtitan's package init
    # (flame.compat.torchtitan_job_config), seconds of the prewarm's start.
    from flame.parallelize.checks import uses_cuda_graphs

    policy = job_config.activation_checkpoint.chunk_states
    if policy == "auto":
        return "save" if uses_cuda_graphs(job_config.compile) else "recompute"
    return policy
