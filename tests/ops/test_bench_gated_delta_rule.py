"""bench/gated_delta_rule.py on the CPU: the flame variant's row (what served the call, its time, its error against
the float64 reference), an op that is wrong shows its error, and a variant that fails or runs out of time has a row
that says so."""

import importlib.util
import json

import pytest
import torch

from tests.checkpoint.helpers import REPO

SCRIPT = REPO / "bench" / "gated_delta_rule.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("gated_delta_rule_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flame_row_on_the_cpu_is_the_pytorch_implementation_within_float32_error():
    bench = load_bench()
    args = bench.parse(["--device", "cpu", "--tiny", "--variant", "flame", "--shapes", "3x16x24,2x32x8"])
    rows = bench.measure_variant(args)
    assert [(r["shape"], r["served_by"]) for r in rows] == [("3x16x24", "pytorch"), ("2x32x8", "pytorch")]
    for row in rows:
        assert 0 < row["error"] < 1e-5 and row["ms"] > 0, row
    text = bench.table(rows, ["3x16x24", "2x32x8"], ["flame"])
    assert text.splitlines()[2].startswith("| 3x16x24 | ") and ", pytorch)" in text.splitlines()[2]


def test_a_wrong_op_shows_its_error(monkeypatch):
    bench = load_bench()
    from flame.ops.gated_delta_rule import chunk_gated_delta_rule

    def off_by_a_little(**kw):
        kw["beta"] = kw["beta"] * 1.001  # a wrong gate scale: every output and gradient moves a little
        return chunk_gated_delta_rule(**kw)

    monkeypatch.setattr(
        bench, "variant_op", lambda variant, device: (off_by_a_little, lambda tensors: "wrong")
    )
    (row,) = bench.measure_variant(bench.parse(["--device", "cpu", "--tiny", "--variant", "flame"]))
    assert 1e-5 < row["error"] < 1e-1, row


def test_variants_that_fail_or_run_out_of_time_have_rows_that_say_so(tmp_path):
    bench = load_bench()
    args = bench.parse(["--device", "cpu", "--tiny", "--timeout_s", "0.01"])
    rows = bench.run_variant("flame", args, tmp_path)
    assert rows == [{"variant": "flame", "shape": "3x16x24", "failed": "no result within 0 s"}]
    assert "| 3x16x24 | failed: no result within 0 s |" in bench.table(rows, ["3x16x24"], ["flame"])
    # FLA's kernels on a CPU: the child reports the failure in the row and the run goes on.
    fla = bench.parse(["--device", "cpu", "--tiny", "--variant", "fla"])
    assert bench.measure_variant(fla)[0]["failed"] == "RuntimeError: FLA's kernels need a CUDA device"


def test_a_variant_stopped_mid_run_keeps_the_shapes_it_finished(monkeypatch, tmp_path):
    """The child writes each shape's row as it finishes: a time limit that stops it during the second shape (here
    an exit at that shape's inputs) leaves the first one's measurement in the table."""
    bench = load_bench()
    draw = bench.inputs

    def exit_at_the_second_shape(shape, *args):
        if shape == "2x32x8":
            raise SystemExit(1)
        return draw(shape, *args)

    monkeypatch.setattr(bench, "inputs", exit_at_the_second_shape)
    out = tmp_path / "flame.json"
    args = bench.parse(
        ["--device", "cpu", "--tiny", "--variant", "flame", "--shapes", "3x16x24,2x32x8", "--json", str(out)]
    )
    with pytest.raises(SystemExit):
        bench.measure_variant(args)
    (row,) = json.loads(out.read_text())
    assert row["shape"] == "3x16x24" and row["ms"] > 0


def test_the_table_goes_into_the_doc_and_a_failed_variant_fails_the_exit_status(monkeypatch, tmp_path):
    bench = load_bench()
    rows = {
        "flame": [{"variant": "flame", "shape": "3x16x24", "served_by": "fla", "ms": 2.5, "error": 4e-3,
                   "worst": "o", "first_call_s": 30.0}],
        "fla": [{"variant": "fla", "shape": "3x16x24", "failed": "no result within 600 s"}],
    }  # fmt: skip
    monkeypatch.setattr(bench, "run_variant", lambda variant, args, work: rows[variant])
    doc = tmp_path / "performance.md"
    assert bench.main(["--device", "cpu", "--tiny", "--variants", "flame,fla", "--doc", str(doc)]) == 1
    marker = f"bench_gated_delta_rule_{bench.device_slug(bench.device_name(torch.device('cpu')))}"  # one per device
    section = doc.read_text().split(f"<!-- {marker} -->")[1]
    assert "| 3x16x24 | 2.50 ms (4.0e-03 in o, fla) | failed: no result within 600 s |" in section
    assert "First call (autotuning and compilation): flame 3x16x24 30.0 s." in section
    assert "Command: `python bench/gated_delta_rule.py --device cpu --tiny --variants flame,fla" in section


def test_a_gpu_cell_ranks_by_the_kernels_time_and_shows_the_wall_time_beside_it():
    """On a GPU an eager call's host work can take as long as its kernels: the cell leads with the kernels' time."""
    bench = load_bench()
    rows = [{"variant": "flame", "shape": "3x16x24", "served_by": "fla", "ms": 2.9, "kernel_ms": 2.24,
             "error": 7.6e-3, "worst": "v"}]  # fmt: skip
    assert bench.table(rows, ["3x16x24"], ["flame"]).splitlines()[2] == (
        "| 3x16x24 | 2.24 ms (2.90 wall; 7.6e-03 in dv, fla) |"
    )


def test_the_kernel_table_lists_each_cells_longest_kernels_and_the_rest_together():
    bench = load_bench()
    rows = [
        {"variant": "flame", "shape": "6x256x512", "kernel_ms": 4.0,
         "kernels": {"dhu": 2.0, "fwd_h": 1.0, "dqkwg": 0.6, "cumsum": 0.4}},
        {"variant": "fla", "shape": "6x256x512", "failed": "refused"},
    ]  # fmt: skip
    assert bench.kernel_table(rows, top=2).splitlines()[2:] == [
        "| 6x256x512 | flame | dhu | 2.000 | 50% |",
        "| 6x256x512 | flame | fwd_h | 1.000 | 25% |",
        "| 6x256x512 | flame | 2 others | 1.000 | 25% |",
    ]
    assert bench.kernel_table(rows[1:], top=2) == ""
