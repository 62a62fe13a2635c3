"""bench/fsdp_scaling.py on the CPU with a tiny model: a one-process run and a 2-rank gloo run of the throughput
bench, their per-GPU tokens/s side by side with the share, the rows under the target with each rank's timeline,
and runs cut by the time limit reported as such."""

import subprocess
import sys

from tests.checkpoint.helpers import REPO

SCRIPT = REPO / "bench" / "fsdp_scaling.py"


def scaling(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--gpus", "1,2", "--mode",
                           "eager", "--warmup", "1", "--steps", "2", *options],
                          capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip


def test_scaling_table_of_one_and_two_ranks(tmp_path):
    doc = tmp_path / "performance.md"
    # A target no CPU run reaches, so that the rows list their ranks' timelines.
    result = scaling("--models", "transformer", "--target", "100", "--doc", str(doc))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    section = doc.read_text().split("<!-- bench_fsdp_scaling -->")[1].split("<!-- /bench_fsdp_scaling -->")[0]
    row = next(line for line in section.splitlines() if line.startswith("| transformer |"))
    seq, one, two = [cell.strip() for cell in row.strip("|").split("|")][1:]
    assert seq == "64" and float(one.replace(",", "")) > 0, row
    per_gpu, share = two.rstrip("%)").split(" (")
    ratio = float(per_gpu.replace(",", "")) / float(one.replace(",", ""))  # of the rounded figures
    assert abs(ratio / (float(share) / 100) - 1) < 0.01, row
    assert "Runs: 1 GPU: finished; 2 GPUs: finished." in section
    assert "- transformer, seq 64, 2 GPUs" in section
    assert "rank 0: no GPU kernels recorded; rank 1: no GPU kernels recorded" in section
    assert "Command: `python bench/fsdp_scaling.py --device cpu" in section


def test_runs_cut_by_the_time_limit_are_reported_and_fail_the_exit_status():
    result = scaling("--models", "transformer", "--timeout_s", "0.5", "--no_write")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| transformer | 64 | not measured | not measured |" in result.stdout
    assert "Runs: 1 GPU: stopped after 0 s; 2 GPUs: stopped after 0 s." in result.stdout
