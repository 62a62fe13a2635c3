"""bench/families.py (a GPU benchmark) on the CPU: a tiny Llama goes through all four steps (train, resume,
export, anchor) and its row says the resume repeats the run bit for bit and the export computes flame's logits; a
family that cannot be built gets a row with its reason while the others still run. Every step's command runs in
this process (train.sh's ranks as flame.train's main, the converter's and the script's own main), so the test
takes seconds where four train.sh launches would take minutes; the commands are the ones the script launches."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer_helpers import free_port
from tests.utils.helpers import process_ends

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import families  # noqa: E402

pytestmark = pytest.mark.slow

TINY = ["--size", "tiny", "--steps", "4", "--seq_len", "32", "--batch_size", "2", "--anchor_steps", "1",
        "--device", "cpu"]  # fmt: skip


@pytest.fixture
def in_process(monkeypatch, capsys):
    """families.run_command running each command in this process; the commands it saw, in order."""
    from flame import compat
    from flame.cli import convert_dcp_to_hf
    from flame.train.trainer import main as train_main

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "localhost"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    compat.apply()
    commands = []

    def run_command(command, log, timeout_s, env):
        commands.append(command)
        capsys.readouterr()
        if command[0] == "bash":
            assert command[1].endswith("train.sh") and env["NGPU"] == "1"
            monkeypatch.setenv("MASTER_PORT", str(free_port()))
            status = train_main(command[2:])
        elif command[1:3] == ["-m", "flame.cli.convert_dcp_to_hf"]:
            status = convert_dcp_to_hf.main(command[3:])
        else:
            assert command[1] == str(REPO / "bench" / "families.py")
            status = families.main(command[2:])
        out = capsys.readouterr()
        return status, out.out, out.err

    monkeypatch.setattr(families, "run_command", run_command)
    return commands


def test_a_tiny_llama_trains_resumes_exports_and_runs_its_anchor(tmp_path, in_process, capsys):
    doc = tmp_path / "models.md"
    doc.write_text("# Models\n")
    argv = [
        *TINY,
        "--families",
        "llama",
        "--work",
        str(tmp_path),
        "--doc",
        str(doc),
        "--keep_runs",
        "--row_json",
    ]
    assert families.main(argv) == 0
    printed = capsys.readouterr().out
    # A --gpus worker's row, as its parent reads it back.
    log = tmp_path / "llama.log"
    log.write_text(printed)
    assert families.table([families.worker_row("llama", 0, log)]) == families.table(
        [families.Row(**json.loads(printed.split(families.ROW_PREFIX)[1].splitlines()[0]))]
    )
    assert "| llama | 0.6M |" in families.table([families.worker_row("llama", 0, log)])
    assert [c[1].rsplit("/", 1)[-1] if c[0] == "bash" else c[2] for c in in_process] == [
        "train.sh", "train.sh", "flame.cli.convert_dcp_to_hf", "--compare_export", "--anchor_of"]  # fmt: skip
    (row,) = [line for line in printed.splitlines()[-3:] if line.startswith("| llama ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "0.6M", cells  # LlamaForCausalLM at the tiny shape
    assert cells[7].startswith("equal (max rel 0.0e+00)"), cells
    assert cells[8].startswith("pass ("), cells
    assert float(cells[3].replace(",", "")) > 0 and float(cells[9].replace(",", "")) > 0, cells
    assert cells[11] == "", cells
    # The resumed run started from the half-way checkpoint, and no CPU table lands in the doc by default.
    assert sorted(p.name for p in (tmp_path / "llama" / "resumed" / "checkpoint").iterdir()) == [
        "step-2",
        "step-4",
    ]
    assert doc.read_text() == "# Models\n"


def test_families_that_cannot_be_built_get_their_reason(tmp_path, in_process, capsys, monkeypatch):
    import fla.layers.mla

    from flame.models.generic import model as generic_model

    # FLA's MLA as it is where flame does not give its module flame's flash-attn functions: refused when built.
    monkeypatch.setattr(generic_model, "fla_flash_attn_calls_on_flame", lambda functions: None)
    monkeypatch.setattr(fla.layers.mla, "flash_attn_func", None)
    doc = tmp_path / "models.md"
    argv = [
        *TINY,
        "--families",
        "mla,no_such_model",
        "--work",
        str(tmp_path),
        "--doc",
        str(doc),
        "--write_doc",
    ]
    assert families.main(argv) == 0
    assert in_process == []  # refused while building on the meta device, before any process
    section = doc.read_text().split("<!-- bench_families -->")[1]
    assert "- run: `python bench/families.py --size tiny" in section
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ")}
    assert "build: needs flash-attn, which flame does not install" in rows["mla"]
    assert "build: " in rows["no_such_model"] and "no_such_model" in rows["no_such_model"].split("|")[-2]
    # A run of some families replaces their rows and keeps the others', with the runs they came from.
    argv[argv.index("--families") + 1] = "no_such_model,samba"
    assert families.main(argv) == 0
    section = doc.read_text().split("<!-- bench_families -->")[1]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")]
    assert rows == ["family", "mla", "samba", "no_such_model"]  # FLA's families first, in order
    runs = [line for line in section.splitlines() if line.startswith("- run: ")]
    assert (
        len(runs) == 2
        and runs[0].endswith(": mla, no_such_model")
        and runs[1].endswith(": no_such_model, samba")
    )


def test_known_reasons_and_verdicts():
    hopper = "Traceback ...\n[rank0]:RuntimeError: Triton >= 3.4.0 ... gated chunk_bwd_dqkwg (see #640). Please upgrade"
    assert families.reason_of(hopper).startswith(
        "FLA's Hopper guard on its gated backward (fla-org/flash-linear"
    )
    assert families.reason_of("a\n\n[rank0]:error: last words\n") == "error: last words"
    dynamo = (
        "[rank0]:[rank0]: torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n"
        "[rank0]:[rank0]: RuntimeError: Output 0 of AsStridedBackward0 is a view\n\n"
        "[rank0]:[rank0]: Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n"
    )
    assert families.reason_of(dynamo) == "RuntimeError: Output 0 of AsStridedBackward0 is a view"
    # FLA's Mamba fallback is named from a traceback through FLA's layer file, not through flame's layers for it
    fla_fallback = (
        'File "/site/fla/layers/mamba.py", line 385, in slow_forward\ntorch.OutOfMemoryError: CUDA out'
    )
    assert families.reason_of(fla_fallback).startswith("FLA's Mamba layers ran their PyTorch fallback")
    flames_layer = (
        'File "/repo/flame/models/layers/fla_mamba.py", line 40, in slow_forward\nRuntimeError: boom'
    )
    assert families.reason_of(flames_layer) == "RuntimeError: boom"
    logged = (
        "[rank0]:[titan] ... step  6/30  loss  7.9  grad_norm 2.1  lr 1e-3  tok/s 411  mem 3.1GiB\n"
        "[rank0]:[titan] ... step  7/30  loss  7.8  grad_norm 2.0  lr 1e-3  tok/s 436  mem 3.1GiB\n"
        "UserWarning: something\ntimed out after 400 s"
    )
    assert families.reason_of(logged) == "timed out after 400 s, at step 7 of 30 (436 tokens/s)"
    assert families.reason_of("autotuning ...\ntimed out after 300 s") == (
        "timed out after 300 s, before its first logged step"
    )
    assert families.resume_verdict({1: 2.0, 2: 1.0}, {2: 1.0}, "cpu") == "equal (max rel 0.0e+00)"
    assert families.resume_verdict({1: 2.0, 2: 1.0}, {2: 1.0005}, "cpu").startswith(
        "differs (max rel 5.0e-04"
    )
    assert families.resume_verdict({1: 2.0, 2: 1.0}, {2: 1.0005}, "cuda").startswith("equal (max rel 5.0e-04")
    assert families.export_verdict(1e-3, 10.0, "cuda").startswith("pass")
    assert families.export_verdict(1e-3, 10.0, "cpu").startswith("fail")
    assert (
        families.resume_verdict({1: 2.0, 2: 1.0, 3: 1.0, 4: 1.0}, {4: 1.0}, "cpu")
        == "failed: resumed steps [4]"
    )


def test_a_loss_that_turns_nan_is_named_in_the_row():
    losses = {1: 8.5, 2: 8.0, 3: 7.5, 4: float("nan"), 5: float("nan"), 6: float("nan")}
    scalars = {"loss/train": losses, "throughput/tokens_per_second_per_device": dict.fromkeys(losses, 100.0),
               "memory/peak_allocated_gib": {1: 1.0}}  # fmt: skip
    row = families.Row("deltaformer")
    families.fill_training(row, scalars, tokens_per_step=100, steps=6)
    assert row.note == "the loss is not finite from step 4 (step 3: 7.50)" and not row.loss_falls
    finite = families.Row("llama")
    families.fill_training(finite, {**scalars, "loss/train": dict.fromkeys(losses, 1.0)}, 100, 6)
    assert finite.note == ""


def test_export_logits_compared_in_bf16_where_a_kernel_refuses_float32():
    """The export check's forward runs in float32; a model whose kernel takes half precision only (FLA's stick-breaking
    attention raises TypeError) is compared under bf16 autocast, and the verdict says so."""
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)

    def half_only():
        if not torch.is_autocast_enabled("cpu"):
            raise TypeError("Stick-breaking projections require matching fp16/bf16 tensors")
        return linear(x), linear(x)

    (theirs, ours), precision = families.compared_logits(half_only, "cpu")
    assert precision == "bf16 autocast, float32 refused: TypeError" and theirs.dtype == torch.float32
    torch.testing.assert_close(ours, linear(x).detach(), rtol=2e-2, atol=2e-2)
    (plain, _), precision = families.compared_logits(lambda: (linear(x), linear(x)), "cpu")
    assert precision == "float32" and torch.equal(plain, linear(x).detach())
    assert families.export_verdict(
        0.0, 1.0, "cuda", precision="bf16 autocast, float32 refused: TypeError"
    ) == ("pass (max diff 0.0e+00, rel 0.0e+00; bf16 autocast, float32 refused: TypeError)")


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path):
    command = [
        "bash",
        "-c",
        "sleep 30 & echo $!; wait",
    ]  # a child that outlives its parent unless its group dies
    status, stdout, stderr = families.run_command(command, tmp_path / "step.log", 1, {})
    assert status == 124 and stderr.endswith("timed out after 1 s")
    assert process_ends(int(stdout)), "the step's child outlived the timeout"


def test_rows_written_as_each_family_finishes_and_runs_sharing_the_doc_keep_each_others(
    tmp_path, monkeypatch
):
    """The doc holds a family's row as soon as it finishes (a run stopped part-way keeps it), and two runs that
    write the same doc, as runs on two GPUs of one machine do, each keep the other's rows and run line."""
    doc = tmp_path / "models.md"
    doc.write_text("# Models\n")
    seen = []

    def run_family(family, args):
        seen.append(doc.read_text())
        return families.Row(family, note=f"measured {family}")

    monkeypatch.setattr(families, "run_family", run_family)
    argv = [*TINY, "--work", str(tmp_path), "--doc", str(doc), "--write_doc", "--families"]
    assert families.main([*argv, "mla,gla"]) == 0
    assert "measured mla" in seen[1] and "measured gla" not in seen[1]
    assert families.main([*argv, "samba"]) == 0  # the other run
    section = doc.read_text().split("<!-- bench_families -->")[1]
    assert [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")] == [
        "family", "gla", "mla", "samba"]  # fmt: skip
    runs = [line for line in section.splitlines() if line.startswith("- run: ")]
    assert [run.rsplit(": ", 1)[1] for run in runs] == ["mla, gla", "samba"]


def test_a_write_waits_for_the_lock_another_run_holds(tmp_path):
    import fcntl
    import threading

    doc = tmp_path / "models.md"
    doc.write_text("# Models\n")
    args = families.parse([*TINY, "--work", str(tmp_path)])
    with open(doc, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the other run, mid-write
        writer = threading.Thread(
            target=families.write_sources,
            args=(doc, [families.run_source([families.Row("gla")], "- run: x: gla")], args),
        )
        writer.start()
        writer.join(timeout=1.0)
        assert writer.is_alive() and "bench_families" not in doc.read_text()
    writer.join(timeout=60.0)
    assert not writer.is_alive() and "| gla |" in doc.read_text()


def test_a_terminated_run_takes_its_steps_processes_with_it(tmp_path):
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    script = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import families; "
              "families.stop_on_sigterm(); "
              f"families.run_command(['bash', '-c', 'sleep 30 & echo $! > {pid_file}; wait'], "
              f"__import__('pathlib').Path({str(tmp_path / 'step.log')!r}), 60, {{}})")  # fmt: skip
    run = subprocess.Popen([sys.executable, "-c", script])
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.1)
    child = int(pid_file.read_text())
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 128 + signal.SIGTERM
    assert process_ends(child), "the step's child outlived the terminated run"


def test_tables_written_elsewhere_merge_into_the_doc(tmp_path, monkeypatch):
    """--merge: rows of other copies of the doc (runs on other machines) over the doc's, later copies over
    earlier ones, each run line kept while a row of its own remains."""
    monkeypatch.setattr(
        families, "run_family", lambda family, args: families.Row(family, note=f"{family} {tag}")
    )
    copies = []
    for tag, names in [("a", "gla,llama"), ("b", "llama,samba"), ("c", "mla")]:
        copies.append(tmp_path / f"{tag}.md")
        run = [*TINY, "--work", str(tmp_path), "--doc", str(copies[-1]), "--write_doc", "--families", names]
        assert families.main(run) == 0
    doc = copies[2]
    assert families.main([*TINY, "--doc", str(doc), "--merge", str(copies[0]), str(copies[1])]) == 0
    rows, runs = families.section_of(doc.read_text())
    assert {family: line.split("|")[-2].strip() for family, line in rows.items()} == {
        "gla": "gla a", "mla": "mla c", "samba": "samba b", "llama": "llama b"}  # fmt: skip
    assert [run.rsplit(": ", 1)[1] for run in runs] == ["mla", "gla, llama", "llama, samba"]
    (missing,) = [line for line in doc.read_text().splitlines() if line.startswith("No row yet (not run): ")]
    assert "gla" not in missing.split(": ")[1].rstrip(".").split(", ") and "qwen3, " in missing


def test_a_merged_copy_brings_only_the_rows_its_own_runs_measured(tmp_path, monkeypatch):
    """Copies of the doc made before runs on other machines hold the doc's rows of that time: merged back in any
    order, each brings the rows of its own runs only, never an older row over a newer one."""
    tag = "old"
    monkeypatch.setattr(
        families, "run_family", lambda family, args: families.Row(family, note=f"{family} {tag}")
    )
    doc = tmp_path / "models.md"
    base = [*TINY, "--work", str(tmp_path), "--write_doc"]
    assert families.main([*base, "--doc", str(doc), "--families", "gla,mla,samba"]) == 0
    copies = {name: tmp_path / f"{name}.md" for name in ("x", "y")}
    for path in copies.values():
        path.write_text(doc.read_text())
    for name, measured in (("x", "gla"), ("y", "mla")):
        tag = name
        assert families.main([*base, "--doc", str(copies[name]), "--families", measured]) == 0
    assert families.main([*TINY, "--doc", str(doc), "--merge", str(copies["x"]), str(copies["y"])]) == 0
    rows, runs = families.section_of(doc.read_text())
    assert {family: line.split("|")[-2].strip() for family, line in rows.items()} == {
        "gla": "gla x", "mla": "mla y", "samba": "samba old"}  # fmt: skip
    assert [run.rsplit(": ", 1)[1] for run in runs] == ["gla, mla, samba", "gla", "mla"]


WORKER = """
import json, os, sys, time
family = sys.argv[sys.argv.index("--families") + 1]
started = time.time()
time.sleep(0.5)
if family == "samba":
    sys.exit("worker error: gone")
row = {"family": family, "note": f"gpu {os.environ['CUDA_VISIBLE_DEVICES']} {started:.3f} {time.time():.3f}"}
print("family row: " + json.dumps(row))
"""


def test_families_run_on_several_gpus_one_worker_each(tmp_path, monkeypatch):
    """--gpus 2: two families at a time, each worker on a visible GPU of its own, the next family starting where
    one ended; a worker that dies leaves a row that says so; the doc holds every row."""
    monkeypatch.setattr(
        families, "worker_command", lambda family, args: [sys.executable, "-c", WORKER, "--families", family]
    )
    monkeypatch.setattr(families, "POLL_S", 0.05)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    doc = tmp_path / "models.md"
    argv = [*TINY, "--work", str(tmp_path), "--doc", str(doc), "--write_doc", "--gpus", "2"]
    assert families.main([*argv, "--families", "gla,mla,samba,retnet,llama"]) == 0
    rows, runs = families.section_of(doc.read_text())
    assert sorted(rows) == ["gla", "llama", "mla", "retnet", "samba"] and len(runs) == 1
    notes = {family: line.split("|")[-2].strip() for family, line in rows.items()}
    assert "without a row" in notes["samba"] and "worker error: gone" in notes["samba"]
    spans = {family: note.split() for family, note in notes.items() if family != "samba"}
    assert {span[1] for span in spans.values()} == {"3", "5"}  # the first two visible GPUs
    for gpu in ("3", "5"):  # never two families on one GPU at once
        on_gpu = sorted((float(s[2]), float(s[3])) for s in spans.values() if s[1] == gpu)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(on_gpu, on_gpu[1:]))
    starts = sorted(float(s[2]) for s in spans.values())
    assert starts[1] - starts[0] < 0.4  # two at once
    # The families without a row: none of these five.
    args = families.parse([*argv, "--families", "missing"])
    assert (
        not {"gla", "llama", "mla", "retnet", "samba"} & set(args.family_list) and "rwkv7" in args.family_list
    )


def test_no_family_starts_after_the_start_deadline(tmp_path, monkeypatch):
    """--start_until_s: the families running at the deadline finish and keep their rows; the rest wait for the
    next run (``--families missing``)."""
    monkeypatch.setattr(
        families, "worker_command", lambda family, args: [sys.executable, "-c", WORKER, "--families", family]
    )
    monkeypatch.setattr(families, "POLL_S", 0.05)
    doc = tmp_path / "models.md"
    argv = [*TINY, "--work", str(tmp_path), "--doc", str(doc), "--write_doc", "--gpus", "2"]
    assert families.main([*argv, "--families", "gla,mla,retnet,llama", "--start_until_s", "0.25"]) == 0
    assert sorted(families.section_of(doc.read_text())[0]) == ["gla", "mla"]


def test_a_worker_runs_the_options_it_was_given(tmp_path):
    args = families.parse([*TINY, "--work", str(tmp_path), "--keep_runs", "--families", "gla"])
    command = families.worker_command("gla", args)
    again = families.parse(command[2:])
    assert again.family_list == ["gla"] and again.row_json and not again.write_doc and again.keep_runs
    for option in (
        "size",
        "steps",
        "seq_len",
        "batch_size",
        "lr",
        "anchor_steps",
        "timeout_s",
        "work",
        "device",
    ):
        assert getattr(again, option) == getattr(args, option), option


def test_a_family_that_diverges_at_the_bench_s_rate_trains_at_its_own_and_its_row_says_why(tmp_path):
    args = families.parse([*TINY, "--work", str(tmp_path)])
    lr, note = families.learning_rate("deltaformer", args)
    assert lr == 3e-4 and note.startswith("learning rate 0.0003: FLA's layer feeds b_proj's output")
    assert families.learning_rate("gla", args) == (families.LEARNING_RATE, "")
    command = families.train_command(tmp_path / "run", tmp_path / "config.json", lr, args)
    assert command[command.index("--optimizer.lr") + 1] == "0.0003"
    # The worker picks the family's rate itself.
    assert "--lr" not in families.worker_command("deltaformer", args)

    given = families.parse([*TINY, "--work", str(tmp_path), "--lr", "5e-4"])
    assert families.learning_rate("deltaformer", given) == (5e-4, "")
    again = families.parse(families.worker_command("deltaformer", given)[2:])
    assert again.lr == 5e-4
