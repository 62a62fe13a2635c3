"""The kernel benches (bench/*.py that time Triton kernels) on a machine without a GPU: one line saying so, exit 1."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
@pytest.mark.parametrize(
    "script",
    [
        "bench/softpick_kernel.py",
        "bench/attention_delta.py",
        "bench/ssd.py",
        "bench/dqkwg.py",
        "bench/recurrences.py",
    ],
)
def test_a_kernel_bench_says_it_needs_a_gpu(script):
    result = subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"{script} needs a CUDA GPU (the kernels are Triton); none is visible"
    ]


def test_dqkwg_bench_settings_and_table():
    """bench/dqkwg.py: --settings parse into launch settings, the default is every tuning setting, and each row's
    ratio is FLA TileLang's time over the row's; a refused call's row carries its reason instead of numbers."""
    sys.path.insert(0, str(REPO / "bench"))
    import dqkwg

    from flame.ops.gated_delta_rule.dqkwg_triton import TUNING_CONFIGS

    assert dqkwg.parse_settings("64/32/4/3,128/64/8/2") == [
        {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 3},
        {"BK": 128, "BV": 64, "num_warps": 8, "num_stages": 2},
    ]
    assert len(dqkwg.parse_settings(None)) == len(TUNING_CONFIGS)
    assert dqkwg.parse(["--settings", "64/32/4/3"]).settings == [
        {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 3}
    ]
    for malformed in ("64/32/4", "64/32/4/x"):
        with pytest.raises(SystemExit) as stop:
            dqkwg.parse(["--settings", malformed])
        assert stop.value.code == 2
    rows = {
        "6x256x512": [
            ("flame Triton, BK 128", 0.5, 2e-3, ""),
            ("FLA TileLang", 0.6, 3e-3, ""),
            ("FLA Triton", float("nan"), float("nan"), "RuntimeError: refused"),
        ]
    }
    lines = dqkwg.table(rows).splitlines()[2:]
    assert lines[0] == "| 6x256x512 | flame Triton, BK 128 | 0.500 | 1.20x | 2.0e-03 |"
    assert lines[1] == "| 6x256x512 | FLA TileLang | 0.600 | 1.00x | 3.0e-03 |"
    assert lines[2] == "| 6x256x512 | FLA Triton | RuntimeError: refused | | |"


def test_recurrences_bench_settings():
    """bench/recurrences.py: --settings parse into launch settings and give one pinned row each, after FLA's and the
    autotuned row; a malformed item stops the parser with one line saying what it takes."""
    sys.path.insert(0, str(REPO / "bench"))
    import recurrences

    settings = recurrences.parse_settings("64/8/1,128/16/2")
    assert settings == [
        {"BV": 64, "num_warps": 8, "num_stages": 1},
        {"BV": 128, "num_warps": 16, "num_stages": 2},
    ]
    assert recurrences.parse_settings(None) is None
    rows = recurrences.implementations(recurrences.RECURRENCES["dhu"], 256, settings)
    assert list(rows) == [
        "FLA Triton",
        "flame Triton, autotuned",
        "flame Triton, BV 64, 8 warps, 1 stages",
        "flame Triton, BV 128, 16 warps, 2 stages",
    ]
    assert rows["flame Triton, BV 128, 16 warps, 2 stages"].keywords == {"launch": settings[1]}
    assert recurrences.parse(["--settings", "64/8/1"]).settings == settings[:1]
    with pytest.raises(SystemExit) as stop:
        recurrences.parse(["--settings", "64/8"])
    assert stop.value.code == 2
