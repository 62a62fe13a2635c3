"""bench/train_throughput.py (a GPU benchmark) runs end to end on the CPU with tiny models: one process (eager and
compiled with the eager backend), two processes with FSDP (Muon, without and with offloaded checkpoints) and two
with context parallelism under torchrun; it writes its own section of the performance document and keeps the
others."""

import gc
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "train_throughput.py"

pytestmark = pytest.mark.slow


def run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def rows(section: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ")
    ][1:]


def test_bench_smoke_on_cpu_writes_its_sections(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\n<!-- bench_dataloader -->\nloader table\n<!-- /bench_dataloader -->\n")
    tiny = ["--device", "cpu", "--tiny", "--doc", str(doc)]
    run([sys.executable, str(BENCH), *tiny, "--models", "transformer,hybrid,llama", "--modes", "eager,compiled",
         "--compile_backend", "eager"])  # fmt: skip
    two_ranks = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(BENCH),
                     *tiny, "--models", "gated_deltanet", "--modes", "eager", "--profile", "1",
                     "--activations", "none,full+offload", "--optimizers", "Muon"])  # fmt: skip
    # --profile prints every rank's timeline (no GPU kernels on a CPU) and its host time in each phase of the
    # training step, gathered by rank 0.
    phases = r"host per step \(profiled\): forward_backward ([\d.]+) ms, clip_grad_norm [\d.]+ ms, optimizer [\d.]+ ms"
    for rank in (0, 1):
        found = re.search(rf"^rank {rank}: no GPU kernels recorded; {phases}$", two_ranks.stdout, re.M)
        assert found and float(found.group(1)) > 0, two_ranks.stdout[-3000:]
    # Before the cases, the link's bus bandwidth, measured through the collectives FSDP runs.
    assert re.search(
        r"^link bus bandwidth: all-gather [\d.]+ GB/s, reduce-scatter [\d.]+ GB/s$", two_ranks.stdout, re.M
    )

    text = doc.read_text()
    assert "<!-- bench_dataloader -->\nloader table\n<!-- /bench_dataloader -->" in text
    one = text.split("<!-- bench_train_throughput_1gpu -->")[1].split(
        "<!-- /bench_train_throughput_1gpu -->"
    )[0]
    # Runs over activation modes or optimizers write a section of their own beside the throughput table.
    two = text.split("<!-- bench_train_throughput_2gpu_memory -->")[1].split(
        "<!-- /bench_train_throughput_2gpu_memory -->"
    )[0]
    table = rows(one)
    assert [(r[0], r[5]) for r in table] == [
        ("transformer", "eager"),
        ("transformer", "compiled"),
        ("hybrid", "eager"),
        ("hybrid", "compiled"),
        ("llama", "eager"),  # transformers' class through the generic family
        ("llama", "compiled"),
    ]
    # torch.compile's graph breaks, compiled cases only: flame's transformer block and loss trace whole.
    assert [(r[0], r[5], r[16]) for r in table if r[0] == "transformer"] == [
        ("transformer", "eager", ""),
        ("transformer", "compiled", "0"),
    ]
    for row in table + rows(two):
        # step time, the host's time to issue a step, tokens/s
        assert float(row[8]) > 0 and float(row[9]) > 0 and float(row[10].replace(",", "")) > 0, row
    assert [(r[0], r[2], r[6], r[7]) for r in rows(two)] == [
        ("gated_deltanet", "2", "none", "Muon"),
        ("gated_deltanet", "2", "full+offload", "Muon"),
    ]
    # The offloading case's peak names the host memory its activations took (no GPU peak on a CPU).
    assert rows(two)[0][13] == "n/a" and re.fullmatch(r"n/a \(host \d+\.\d\)", rows(two)[1][13])
    assert "FSDP" in two and "activation memory and optimizers" in two


def test_bench_context_parallel_on_cpu_writes_a_section_of_its_own(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(
        "# Performance\n\n<!-- bench_train_throughput_2gpu -->\nFSDP table\n<!-- /bench_train_throughput_2gpu -->\n"
    )
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(BENCH),
         "--device", "cpu", "--tiny", "--doc", str(doc), "--models", "gated_deltanet,hybrid", "--modes", "eager",
         "--cp", "2"])  # fmt: skip
    text = doc.read_text()
    assert "<!-- bench_train_throughput_2gpu -->\nFSDP table\n" in text
    section = text.split("<!-- bench_train_throughput_2gpu_cp2 -->")[1].split(
        "<!-- /bench_train_throughput_2gpu_cp2 -->"
    )[0]
    assert "## Training throughput, 2 CPUs, context parallel 2" in section
    # 128 tokens per GPU at seq 64 over cp 2: each GPU holds half of 4 rows.
    assert [(r[0], r[2], r[4]) for r in rows(section)] == [
        ("gated_deltanet", "2 (cp 2)", "4"),
        ("hybrid", "2 (cp 2)", "4"),
    ]
    for row in rows(section):
        assert float(row[8]) > 0 and float(row[10].replace(",", "")) > 0, row


def test_gpu_timeline_splits_a_step_into_compute_exposed_communication_and_idle(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from train_throughput import gpu_timeline

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(
            name=name,
            device_type=device,
            is_user_annotation=annotation,
            time_range=SimpleNamespace(start=start, end=end),
        )

    # Two steps over 0..8000 us: compute 0-3000 and 3500-6000 and 5000-8000 (merged: 7500 us), NCCL 2000-4000
    # (500 us of it alone); nothing runs 3000-3500 except NCCL, so no idle time. Host events and annotations
    # do not count.
    events = [
        event("gemm", 0, 3000),
        event("ncclDevKernel_AllGather", 2000, 4000),
        event("flash_fwd", 3500, 6000),
        event("gemm", 5000, 8000),
        event("aten::mm", 0, 9000, device=DeviceType.CPU),
        event("ChunkGatedDeltaRuleFunction", 0, 9500, annotation=True),
    ]
    assert gpu_timeline(events, steps=2) == (
        "GPU timeline per step: 4.0 ms from first to last kernel; compute kernels running 3.8 ms; NCCL kernels "
        "running 1.0 ms, 0.2 ms of it with no compute kernel running; idle 0.0 ms"
    )
    gap = [event("gemm", 0, 1000), event("gemm", 3000, 4000)]
    assert gpu_timeline(gap, steps=1).endswith("0.0 ms of it with no compute kernel running; idle 2.0 ms")


def test_bench_on_flames_data_path_reports_the_wait_for_data(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    monkeypatch.setenv("WORLD_SIZE", "1")
    from train_throughput import main

    doc = tmp_path / "performance.md"
    assert main(["--device", "cpu", "--tiny", "--doc", str(doc), "--models", "transformer", "--modes", "eager",
                 "--data", "real", "--num_workers", "1"]) == 0  # fmt: skip
    section = doc.read_text().split("<!-- bench_train_throughput_1gpu_real_data -->")[1]
    assert "## Training throughput, 1 CPU, flame's data path" in section
    assert "batches of corpus (tokenizer tokenizer) through flame's dataloader (1 workers)" in section
    (row,) = rows(section.split("<!-- /bench_train_throughput_1gpu_real_data -->")[0])
    assert row[0] == "transformer" and row[6:8] == ["none", "AdamW"] and float(row[10].replace(",", "")) > 0
    assert 0 <= float(row[14].rstrip("%")) < 100  # the share of the timed steps spent waiting for batches


def test_bench_anchor_is_the_naive_hf_loop_of_the_same_model(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    monkeypatch.setenv("WORLD_SIZE", "1")
    from train_throughput import main

    assert main(["--device", "cpu", "--tiny", "--no_write", "--models", "transformer", "--modes", "eager",
                 "--anchor"]) == 0  # fmt: skip
    table = capsys.readouterr().out.split("\n\n| model |")[-1]
    naive, flame = rows("| model |" + table)
    assert naive[5] == "naive HF loop" and naive[15] == "1.00x"  # vs naive HF loop
    assert flame[5] == "eager" and naive[1] == flame[1]  # the same parameter count
    naive_tps, flame_tps = (float(r[10].replace(",", "")) for r in (naive, flame))
    # The ratio is printed to 0.005 from the unrounded rates; the table's rates are rounded to 0.5 token/s each.
    rounding = flame_tps / naive_tps * (0.5 / naive_tps + 0.5 / flame_tps) + 0.005
    assert abs(float(flame[15].rstrip("x")) - flame_tps / naive_tps) <= rounding


def test_bench_steps_collect_garbage_as_the_trainer_does(monkeypatch):
    """flame's cases run with torchtitan's collection policy (no automatic collection; the trainer's gc_freq), so a
    collection does not stall one rank mid-step while the others wait; the naive HF loop keeps Python's default."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    monkeypatch.setenv("WORLD_SIZE", "1")
    import train_throughput

    seen = []
    timed = train_throughput.measure

    def observed_measure(result, step, *args, **kwargs):
        def observed_step():
            step()
            seen.append((result.mode, gc.isenabled()))

        timed(result, observed_step, *args, **kwargs)

    monkeypatch.setattr(train_throughput, "measure", observed_measure)
    try:
        assert train_throughput.main(["--device", "cpu", "--tiny", "--no_write", "--models", "transformer",
                                      "--modes", "eager", "--anchor", "--warmup", "1", "--steps", "1"]) == 0  # fmt: skip
        assert gc.isenabled()
    finally:
        gc.enable()
    steps = 1 + 1 + train_throughput.HOST_STEPS  # warm-up, timed, then the host-time steps
    assert seen == [("naive HF loop", True)] * steps + [("eager", False)] * steps


def test_job_flags_reach_every_case_job(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from train_throughput import job_config, parse

    args = parse(
        [
            "--device",
            "cpu",
            "--tiny",
            "--job_flags",
            "--optimizer.implementation foreach --training.max_norm 0.5",
        ]
    )
    config = job_config(64, False, 1, args)
    assert config.optimizer.implementation == "foreach" and config.training.max_norm == 0.5
    assert job_config(64, False, 1, parse(["--device", "cpu", "--tiny"])).optimizer.implementation == "fused"


def test_the_written_command_runs_as_printed(monkeypatch):
    """Every bench writes its command with command_line: an argument with spaces (--job_flags) stays one argument."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import shlex

    from train_throughput import command_line

    argv = ["--job_flags", "--training.varlen --training.context_len 4096", "--quick"]
    assert shlex.split(command_line("bench/train_throughput.py", argv)) == [
        "python", "bench/train_throughput.py", *argv
    ]  # fmt: skip
    launcher = ("torchrun", "--nproc_per_node", "2")
    assert shlex.split(command_line("bench/x.py", [], launcher)) == [*launcher, "bench/x.py"]


def test_a_fake_world_runs_fsdp_or_ddp_in_one_process_and_writes_nothing(tmp_path, monkeypatch):
    """--fake_world: FSDP, or DDP, over a process group of 2 whose collectives do nothing, in one process (their
    host work alone). The row says 2 GPUs and the doc is left alone; --num_layers sets any model's block count."""
    doc = tmp_path / "performance.md"
    result = run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--doc", str(doc), "--models", "transformer",
                  "--modes", "eager", "--fake_world", "2"])  # fmt: skip
    row = [c.strip() for c in result.stdout.split("\n| transformer |")[-1].split("\n")[0].split("|")]
    assert row[1] == "2" and float(row[8]) > 0, row  # GPUs, host s
    assert "(a fake process group of 2: FSDP's host work without communication; not written)" in result.stdout
    assert "link bus bandwidth" not in result.stdout and not doc.exists()
    # DDP over the same fake world (its gradient hook takes the in-place all-reduce's buffer, whatever the
    # backend's future holds).
    result = run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--doc", str(doc), "--models", "transformer",
                  "--modes", "eager", "--fake_world", "2", "--data_parallel", "ddp"])  # fmt: skip
    row = [c.strip() for c in result.stdout.split("\n| transformer |")[-1].split("\n")[0].split("|")]
    assert row[1] == "2" and float(row[8]) > 0, row
    assert "(a fake process group of 2: DDP's host work without communication; not written)" in result.stdout
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from train_throughput import model_args

    for name in ("transformer", "llama"):
        assert model_args(name, True, 24).num_hidden_layers == 24
        assert model_args(name, True).num_hidden_layers == 2


def test_data_parallel_degrees_shard_or_replicate(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from train_throughput import data_parallel_flags

    def degrees(flags):
        return flags[1], flags[3]  # shard, replicate

    assert degrees(data_parallel_flags(4, "fsdp")) == ("4", "1")
    assert degrees(data_parallel_flags(4, "ddp")) == ("1", "4")
    assert degrees(data_parallel_flags(1, "ddp")) == ("1", "1")
