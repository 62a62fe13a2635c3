"""flame.train.kernels: what a GPU process sets up before its model is built (prepare_gpu_kernels), and how the
gated delta rule keeps its chunk states (chunk_states)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flame.config import parse_args
from flame.ops.gated_delta_rule import dqkwg_triton
from flame.train import kernels

FLAME = Path(kernels.__file__).resolve().parents[1]


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


def test_every_flame_autotuner_keeps_its_results_when_only_prepare_gpu_kernels_asked_for_it(tmp_path):
    """A run not started by train.sh (``python -m flame.train``, the benches) leaves TRITON_CACHE_AUTOTUNING to
    prepare_gpu_kernels; a Triton autotuner reads it when it is made, so every one of flame's kernel modules must be
    imported after it is set, or that kernel neither reads the shipped tuning nor tunes once per host."""
    modules = sorted(
        ".".join(path.relative_to(FLAME.parent).with_suffix("").parts)
        for path in (FLAME / "ops").rglob("*.py")
        if "autotune" in path.read_text() and path.name != "autotune.py"
    )
    probe = textwrap.dedent(
        f"""
        import importlib, torch
        from triton.runtime.autotuner import Autotuner
        import flame.compat
        from flame.train import kernels
        kernels.use_shipped_results = lambda name: 0
        kernels.fla_tilelang_attention_takes_what_it_compiles = lambda: None
        flame.compat.serve_gated_dqkwg_on_hopper = lambda kernel: None
        torch.cuda.get_device_name = lambda device: "GPU"
        kernels.prepare_gpu_kernels(torch.device("cuda"))
        for name in {modules!r}:
            for obj in vars(importlib.import_module(name)).values():
                while obj is not None and not isinstance(obj, Autotuner):
                    obj = getattr(obj, "fn", None)
                if obj is not None:
                    print(name, obj.base_fn.__name__, obj.cache_results)
        """
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRITON_CACHE_AUTOTUNING", "TRITON_INTERPRET"))
    }
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    tuners = result.stdout.split("\n")[:-1]
    tuned_modules = {line.split()[0] for line in tuners}
    assert {
        "flame.ops.gated_delta_rule.dqkwg_triton",
        "flame.ops.gated_delta_rule.dhu_triton",
    } <= tuned_modules
    assert [line for line in tuners if not line.endswith("True")] == []


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
