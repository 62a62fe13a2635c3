"""bench/muon_step.py on a CPU: one process and 2 gloo ranks, its table's rows (the matrices Muon takes from each
model, both optimizers' step times, their ratio) and the section it writes."""

import importlib.util
import subprocess
import sys

import torch

from flame.models import build_model
from flame.optim.optimizer import muon_parameters
from tests.checkpoint.helpers import REPO

SCRIPT = REPO / "bench" / "muon_step.py"


def tiny_matrices(name: str) -> tuple[int, int]:
    """(count, elements) of the matrices Muon takes from the bench's tiny ``name``, as train_throughput builds it."""
    spec = importlib.util.spec_from_file_location(
        "train_throughput_bench", REPO / "bench" / "train_throughput.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with torch.device("meta"):
        matrices = muon_parameters(build_model(bench.model_args(name, tiny=True)))
    return len(matrices), sum(p.numel() for p in matrices)


def test_one_and_two_ranks_write_a_row_each(tmp_path):
    doc = tmp_path / "performance.md"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--ranks", "1,2", "--models",
               "transformer", "--steps", "1", "--doc", str(doc)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    section = doc.read_text().split("<!-- bench_muon_step -->")[1].split("<!-- /bench_muon_step -->")[0]
    assert "## Muon's step" in section and "bench/muon_step.py --device cpu --tiny --ranks 1,2" in section
    count, elements = tiny_matrices("transformer")
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| transformer |")]
    assert [row[1:4] for row in rows] == [
        [str(count), f"{elements:,}", "1"],
        [str(count), f"{elements:,}", "2"],
    ]
    for row in rows:
        muon, adamw = float(row[4]), float(row[5])
        assert muon > 0 and adamw > 0
        # the ratio is of the unrounded times: within what the cells' rounding to 0.05 ms (and its own 0.005) allows
        lowest, highest = (muon - 0.05) / (adamw + 0.05), (muon + 0.05) / max(adamw - 0.05, 1e-9)
        assert lowest - 0.005 <= float(row[6].rstrip("x |")) <= highest + 0.005
