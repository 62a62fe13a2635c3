"""The kernel benches (bench/*.py that time Triton kernels) on a machine without a GPU: one line saying so, exit 1."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def tuning_as_before(monkeypatch, tmp_path):
    """A bench's main() tunes as a training job does (flame.ops.autotune.tune_once_per_host: Triton's cache folder
    and caching in the environment, its Autotuner wrapped): all of it undone after each test."""
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "check_disk_cache", Autotuner.check_disk_cache)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)


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
    """bench/dqkwg.py: --settings parse into launch settings, the default (None) is a row for every tuning setting,
    and each row's
    ratio is FLA TileLang's time over the row's; a refused call's row carries its reason instead of numbers."""
    sys.path.insert(0, str(REPO / "bench"))
    import dqkwg

    from flame.ops.gated_delta_rule.dqkwg_triton import TUNING_CONFIGS

    assert dqkwg.parse_settings("64/32/4/3,128/64/8/2") == [
        {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 3},
        {"BK": 128, "BV": 64, "num_warps": 8, "num_stages": 2},
    ]
    assert dqkwg.parse_settings(None) is None
    pinned = [name for name in dqkwg.implementations(None) if name.startswith("flame Triton, BK")]
    assert len(pinned) == len(TUNING_CONFIGS)
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


def bench_module(name: str):
    sys.path.insert(0, str(REPO / "bench"))
    return importlib.import_module(name)


RUN_A = "- `python bench/recurrences.py --recurrences dhu` (shapes 6x256x512,16x96x192; 8 x 2048 tokens; 2026-12-06; a)"
RUN_B = "- `python bench/recurrences.py --batch 4` (shapes 16x128x128; 4 x 2048 tokens; 2026-12-05; b)"
OLD_SECTION = "\n".join(
    [
        "## flame's dh recurrence per launch setting, GPU",
        RUN_A,
        RUN_B,
        "| heads x K x V | implementation | ms | FLA Triton's time / row's | rel. RMS error vs float64 |",
        "|---|---|---:|---:|---:|",
        "| 6x256x512 | FLA Triton | 0.900 | 1.00x | 2.4e-03 |",
        "| 6x256x512 | flame Triton | 0.600 | 1.50x | 2.4e-03 |",
        "| 16x96x192 | FLA Triton | 0.350 | 1.00x | 2.5e-03 |",
        "| 16x96x192 | flame Triton | 0.250 | 1.40x | 2.5e-03 |",
        "| 16x128x128 | FLA Triton | 0.230 | 1.00x | 2.5e-03 |",
    ]
)


def test_kernel_bench_merges_a_shapes_rows_into_the_section():
    """bench/dqkwg.py's merge (bench/recurrences.py's too): a run's rows replace their shape's rows in place; the
    other shapes' rows stay with the run that measured them, narrowed to those shapes; rows and runs at other
    tokens, and sections without run lines, are dropped."""
    dqkwg = bench_module("dqkwg")
    run = "- `python bench/recurrences.py --shapes 6x256x512,10x64x64` (shapes 6x256x512,10x64x64; 8 x 2048 tokens; c)"
    new_rows = [
        "| 6x256x512 | FLA Triton | 0.880 | 1.00x | 2.4e-03 |",
        "| 6x256x512 | flame Triton | 0.550 | 1.60x | 2.4e-03 |",
        "| 10x64x64 | FLA Triton | 0.100 | 1.00x | 2.0e-03 |",
    ]
    runs, rows = dqkwg.merged_with_section(OLD_SECTION, run, new_rows)
    assert runs == [
        "- `python bench/recurrences.py --recurrences dhu` (shapes 16x96x192; 8 x 2048 tokens; 2026-12-06; a)",
        run,
    ]
    assert rows == [*new_rows[:2], *OLD_SECTION.splitlines()[7:9], new_rows[2]]
    assert dqkwg.merged_with_section(OLD_SECTION.replace(RUN_A, "").replace(RUN_B, ""), run, new_rows) == (
        [run],
        new_rows,
    )


@pytest.mark.parametrize(
    ("script", "marker", "title", "arguments", "anchor"),
    [
        ("recurrences", "bench_dhu_fake_gpu", "flame's dh recurrence per launch setting", ["--recurrences", "dhu"],
         "FLA Triton"),
        ("dqkwg", "bench_dqkwg_fake_gpu", "flame's dq/dk/dw/dg kernel per launch setting", [], "FLA TileLang"),
    ],
)  # fmt: skip
def test_kernel_bench_writes_each_shape_as_it_ends(
    tmp_path, monkeypatch, script, marker, title, arguments, anchor
):
    """main() writes its section after each shape, so a run stopped part-way leaves the rows it made beside the
    earlier run's rows of the shapes it did not reach, each named by its run."""
    bench = bench_module(script)
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Performance\n\n<!-- {marker} -->\n{OLD_SECTION}\n<!-- /{marker} -->\n")
    monkeypatch.setattr(bench, "no_cuda_gpu", lambda script: False)
    monkeypatch.setattr(bench, "device_name", lambda device: "Fake GPU")

    def measure(*arguments):
        if "16x96x192" in arguments:
            raise KeyboardInterrupt  # the device call's limit, before the second shape ends
        return [(anchor, 0.8, 2.4e-3, ""), ("flame Triton, autotuned (BV 64)", 0.5, 2.4e-3, "")]

    monkeypatch.setattr(bench, "measure", measure)
    command = [*arguments, "--shapes", "6x256x512,16x96x192", "--doc", str(doc)]
    with pytest.raises(KeyboardInterrupt):
        bench.main(command)
    lines = bench_module("train_throughput").section_in(doc.read_text(), marker).splitlines()
    assert lines[1] == f"## {title}, Fake GPU"
    runs = [line for line in lines if line.startswith("- `")]
    assert runs[0] == RUN_A.replace("6x256x512,16x96x192", "16x96x192")
    assert runs[1].startswith(
        f"- `python bench/{script}.py {' '.join(command)}` (shapes 6x256x512; 8 x 2048 tokens; "
    )
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| heads")]
    assert rows == [
        f"| 6x256x512 | {anchor} | 0.800 | 1.00x | 2.4e-03 |",
        "| 6x256x512 | flame Triton, autotuned (BV 64) | 0.500 | 1.60x | 2.4e-03 |",
        *OLD_SECTION.splitlines()[7:9],
    ]


@pytest.mark.parametrize(("script", "arguments"), [("recurrences", ["--recurrences", "dhu"]), ("dqkwg", [])])
def test_kernel_bench_keeps_its_tuning_results_for_the_bundle(tmp_path, monkeypatch, script, arguments):
    """The autotuned rows' results land in Triton's cache (scripts/autotune_bundle.py bundles them) only if
    TRITON_CACHE_AUTOTUNING (unset here, by the fixture) is set before the kernel's module makes its autotuner,
    that is before the first shape."""
    bench = bench_module(script)
    monkeypatch.setattr(bench, "no_cuda_gpu", lambda script: False)
    monkeypatch.setattr(bench, "device_name", lambda device: "Fake GPU")
    seen = []

    def measure(*arguments):
        seen.append(os.environ.get("TRITON_CACHE_AUTOTUNING"))
        return [("flame Triton, autotuned (BV 64)", 0.5, 2.4e-3, "")]

    monkeypatch.setattr(bench, "measure", measure)
    bench.main([*arguments, "--shapes", "6x256x512", "--doc", str(tmp_path / "performance.md")])
    assert seen == ["1"]


def test_dqkwg_bench_makes_the_kernels_autotuner_after_tuning_results_are_kept(monkeypatch, tmp_path):
    """bench/dqkwg.py with its default settings: the kernel's module, imported first by the bench (it is dropped
    from sys.modules here), makes an autotuner that keeps its results (TRITON_CACHE_AUTOTUNING read when the
    autotuner is made). Reading the default settings while parsing the arguments made it before; an H100 run
    (2026-12-07) tuned three shapes and left scripts/autotune_bundle.py nothing to bundle."""
    import flame.ops.gated_delta_rule as package

    module = "flame.ops.gated_delta_rule.dqkwg_triton"
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delattr(package, "dqkwg_triton", raising=False)
    bench = bench_module("dqkwg")
    monkeypatch.setattr(bench, "no_cuda_gpu", lambda script: False)
    monkeypatch.setattr(bench, "device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(
        bench, "measure", lambda shape, args, settings: bench.implementations(settings) and []
    )
    bench.main(["--shapes", "6x256x512", "--no_write"])
    assert sys.modules[module]._dqkwg_kernel_tuned.cache_results
