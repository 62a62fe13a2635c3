"""flame.train.kernels: what a GPU process sets up before its model is built (prepare_gpu_kernels), and how the
gated delta rule keeps its chunk states (chunk_states)."""

import pytest
import torch

from flame.config import parse_args
from flame.ops.gated_delta_rule import dqkwg_triton
from flame.train import kernels


def test_a_gpu_process_tunes_once_seeds_the_shipped_results_and_fixes_flas_backends(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "tune_once_per_host", lambda: calls.append("tune once per host"))
    monkeypatch.setattr(
        kernels, "use_shipped_results", lambda name: calls.append(f"shipped results for {name}")
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU {device.index}")
    monkeypatch.setattr(
        dqkwg_triton, "serve_where_fla_refuses", lambda: calls.append("flame's dqkwg for FLA")
    )
    monkeypatch.setattr(
        kernels,
        "fla_tilelang_attention_takes_what_it_compiles",
        lambda: calls.append("FLA's TileLang attention on its head widths"),
    )

    kernels.prepare_gpu_kernels(torch.device("cpu"))
    assert calls == []
    kernels.prepare_gpu_kernels(torch.device("cuda", 1))
    assert calls == [
        "tune once per host",
        "shipped results for GPU 1",
        "flame's dqkwg for FLA",
        "FLA's TileLang attention on its head widths",
    ]


@pytest.mark.parametrize(
    ("flags", "policy"),
    [
        ([], "recompute"),
        (["--compile.enable", "--compile.mode", "reduce-overhead"], "save"),
        (["--compile.mode", "reduce-overhead"], "recompute"),  # not compiled: no CUDA graphs
        (["--compile.enable", "--compile.mode", "max-autotune-no-cudagraphs"], "recompute"),
        (["--activation_checkpoint.chunk_states", "save"], "save"),
        (
            [
                "--compile.enable",
                "--compile.mode",
                "reduce-overhead",
                "--activation_checkpoint.chunk_states",
                "recompute",
            ],
            "recompute",
        ),  # fmt: skip
    ],
)
def test_chunk_states_auto_keeps_them_where_the_blocks_replay_as_cuda_graphs(flags, policy):
    assert kernels.chunk_states(parse_args(flags)) == policy
