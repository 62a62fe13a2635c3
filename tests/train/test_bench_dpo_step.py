"""bench/dpo_step.py (a GPU benchmark) runs end to end on the CPU with tiny models and writes its section."""

import sys

import pytest

from tests.parallelize.test_bench_throughput import REPO, rows, run

pytestmark = pytest.mark.slow


def test_dpo_bench_smoke_on_cpu_writes_the_ratio(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n")
    bench = str(REPO / "bench" / "dpo_step.py")
    output = run(
        [sys.executable, bench, "--device", "cpu", "--tiny", "--doc", str(doc), "--profile", "1"]
    ).stdout
    # --profile prints each model's GPU timeline per rank (none on a CPU).
    assert output.count("rank 0: no GPU kernels recorded") == 2
    text = doc.read_text()
    section = text[text.index("<!-- bench_dpo_step_1gpu -->") : text.index("<!-- /bench_dpo_step_1gpu -->")]
    assert "DPO step, hybrid against transformer, 1 CPU" in section
    table = {row[0]: row for row in rows(section)}
    assert set(table) == {"transformer", "hybrid"}
    assert table["transformer"][-1] == "1.000"
    hybrid, transformer = (float(table[name][3]) for name in ("hybrid", "transformer"))
    # The step times are printed to 1 ms, the ratio from the unrounded ones.
    ratio = float(table["hybrid"][-1])
    assert (hybrid - 5e-4) / (transformer + 5e-4) <= ratio <= (hybrid + 5e-4) / (transformer - 5e-4)
