"""bench/fsdp_scaling.py on the CPU: runs cut by the time limit reported as such (a one-process and a 2-rank gloo
run of the throughput bench with a tiny model); the table from the runs' records (per-GPU tokens/s side by side with
the share, the rows under the target with each rank's timeline, the link) written from several invocations; the GPU
links read from nvidia-smi's matrix. The throughput bench's own 2-rank run is tests/parallelize/test_bench_throughput's."""

import importlib.util
import json
import subprocess
import sys

from tests.checkpoint.helpers import REPO

SCRIPT = REPO / "bench" / "fsdp_scaling.py"


def scaling(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--gpus", "1,2", "--mode",
                           "eager", "--warmup", "1", "--steps", "2", *options],
                          capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip


def test_runs_cut_by_the_time_limit_are_reported_and_fail_the_exit_status():
    result = scaling("--models", "transformer", "--timeout_s", "0.5", "--no_write")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| transformer | 64 | not measured | not measured |" in result.stdout
    assert "Runs: 1 GPU: stopped after 0 s; 2 GPUs: stopped after 0 s." in result.stdout


def load_script():
    spec = importlib.util.spec_from_file_location("fsdp_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_record(model: str, tokens: dict[int, float], endings: dict[int, str], command: str) -> dict:
    def result(n):
        timelines = [f"{model} rank {r} timeline" for r in range(n)]
        return {
            "model": model,
            "seq_len": 2048,
            "error": "",
            "tokens_per_s": tokens[n],
            "step_s": 16384 / tokens[n],
            "host_s": 0.5 * n,
            "timelines": timelines,
        }

    records = {
        str(n): {"device": "NVIDIA H200", "torch": "2.11.0", "results": [result(n)],
                 "link_bus_GBps": {"all-gather": 7.25, "reduce-scatter": 12.5} if n > 1 else None}
        for n in tokens
    }  # fmt: skip
    return {"command": command, "models": [model], "seq_lens": [2048], "mode": "compiled", "warmup": 3,
            "steps": 8, "target": 0.95, "links": "NV18 (0-1)", "date": "2026-11-26", "records": records,
            "endings": {str(n): e for n, e in endings.items()}, "seconds": 100}  # fmt: skip


def test_merge_writes_one_table_from_invocations_on_one_host(tmp_path):
    """A host measured in two invocations (a device call's time limit): one table, both commands, every run's ending,
    the link figures, and the timelines of the rows under the target; not all finished, so exit status 1."""
    first = tmp_path / "a.json"
    second = tmp_path / "b.json"
    first.write_text(
        json.dumps(run_record("transformer", {1: 100.0, 2: 96.0}, {1: "finished", 2: "finished"}, "A"))
    )
    second.write_text(
        json.dumps(run_record("hybrid", {1: 200.0, 2: 150.0}, {1: "finished", 2: "stopped after 300 s"}, "B"))
    )
    doc = tmp_path / "performance.md"
    assert load_script().main(["--merge", str(first), str(second), "--doc", str(doc)]) == 1
    section = doc.read_text()
    assert "| transformer | 2048 | 100 | 96 (96.0%) |" in section
    assert "| hybrid | 2048 | 200 | 150 (75.0%) |" in section
    assert "Commands: `A` then `B` (one table by `python bench/fsdp_scaling.py --merge" in section
    assert "on 2 x NVIDIA H200, torch 2.11.0 (2026-11-26)" in section and "Total 200 s." in section
    assert "GPU links (nvidia-smi topo -m): NV18 (0-1)." in section
    assert "Runs: 1 GPU: finished, finished; 2 GPUs: finished, stopped after 300 s." in section
    assert "Link bus bandwidth (64 MiB per call, slowest rank): 2 GPUs: all-gather 7.2 GB/s" in section
    assert (
        "- hybrid, seq 2048, 2 GPUs (75.0%): step 109.227 s, the host issues it in 1.000 s (1 GPU: step 81.920 s, "
        "host 0.500 s); rank 0: hybrid rank 0 timeline; rank 1: hybrid rank 1" in section
    )
    assert "- transformer" not in section


def test_links_from_nvidia_smi_topology():
    matrix = (
        "\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV18\tSYS\tPIX\t0-31\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tSYS\tSYS\t0-31\t0\t\tN/A\n"
        "GPU2\tSYS\tSYS\t X \tSYS\t32-63\t1\t\tN/A\n"
        "NIC0\tPIX\tSYS\tSYS\t X \n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
    )
    assert load_script().links_of_matrix(matrix) == "NV18 (0-1); SYS (0-2, 1-2)"


def test_ddp_runs_replicate_over_the_gpus_and_write_their_own_section(tmp_path):
    script = load_script()
    args = script.parse(["--device", "cpu", "--tiny", "--gpus", "1,2", "--data_parallel", "ddp",
                         "--job_flags", "--optimizer.implementation foreach"])  # fmt: skip
    two = script.bench_command(2, args, tmp_path / "r.json", "ddp")
    assert two[two.index("--job_flags") + 1] == "--optimizer.implementation foreach"
    assert two[two.index("--data_parallel") + 1] == "ddp" and "--data_parallel" not in script.bench_command(
        1, args, tmp_path / "r.json", "ddp"
    )
    ddp = dict(
        run_record("transformer", {1: 100.0, 2: 99.0}, {1: "finished", 2: "finished"}, "C"),
        data_parallel="ddp",
    )
    fsdp = run_record("transformer", {1: 100.0, 2: 80.0}, {1: "finished", 2: "finished"}, "D")
    (tmp_path / "ddp.json").write_text(json.dumps(ddp))
    (tmp_path / "fsdp.json").write_text(json.dumps(fsdp))
    doc = tmp_path / "performance.md"
    assert script.main(["--merge", str(tmp_path / "ddp.json"), "--doc", str(doc)]) == 0
    assert script.main(["--merge", str(tmp_path / "fsdp.json"), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "## DDP scaling" in text and "| transformer | 2048 | 100 | 99 (99.0%) |" in text
    assert "## FSDP scaling" in text and "| transformer | 2048 | 100 | 80 (80.0%) |" in text
    other_host = ["--merge", str(tmp_path / "ddp.json"), str(tmp_path / "fsdp.json"), "--doc", str(doc)]
    assert script.main([*other_host, "--host", "B"]) == 0
    both = doc.read_text()
    assert both.startswith(text.rstrip("\n")), "the first host's sections are kept"
    assert "## FSDP scaling, host B" in both and "## DDP scaling, host B" in both
    assert "<!-- bench_ddp_scaling_B -->" in both and "<!-- /bench_fsdp_scaling_B -->" in both


def test_fsdp_and_ddp_runs_share_one_single_gpu_run_and_keep_each_run_in_the_json_file(tmp_path):
    """--data_parallel fsdp,ddp: one one-GPU run, then a 2-rank run of each kind; the --json file holds both kinds."""
    report = tmp_path / "runs.json"
    result = scaling("--models", "transformer", "--timeout_s", "0.5", "--no_write", "--data_parallel", "fsdp,ddp",
                     "--json", str(report))  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("== 1 GPU:") == 1 and result.stdout.count("== 2 GPUs:") == 2
    fsdp, ddp = json.loads(report.read_text())
    assert (fsdp["data_parallel"], ddp["data_parallel"]) == ("fsdp", "ddp")
    assert set(fsdp["endings"]) == set(ddp["endings"]) == {"1", "2"}
    assert "FSDP scaling" in result.stdout and "DDP scaling" in result.stdout
