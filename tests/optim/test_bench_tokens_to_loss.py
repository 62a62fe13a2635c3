"""bench/tokens_to_loss.py with train.sh replaced by a writer of TensorBoard events: the launch line per optimizer,
the target (the highest last validation loss), each run's step, tokens and seconds to it, a failed run's row and
the exit status. (The launches themselves are train.sh's, tested in tests/train.)"""

import importlib.util
import subprocess

from torch.utils.tensorboard import SummaryWriter

from tests.checkpoint.helpers import REPO

SCRIPT = REPO / "bench" / "tokens_to_loss.py"
START = 1_700_000_000.0
# Per optimizer: validation losses at steps 2, 4, 6, and the wall time of each step (seconds after START).
CURVES = {"AdamW": ([5.0, 4.0, 3.5], 1.0), "Muon": ([4.5, 3.4, 3.2], 1.5)}


def load_bench():
    spec = importlib.util.spec_from_file_location("tokens_to_loss_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_train_sh(launched: list[list[str]]):
    def run(command, cwd, env, stdout, stderr):
        launched.append([f"NGPU={env['NGPU']}", *command[1:]])
        dump = command[command.index("--job.dump_folder") + 1]
        optimizer = command[command.index("--optimizer.name") + 1]
        if optimizer == "Lion":
            return subprocess.CompletedProcess(command, 1)
        losses, seconds_per_step = CURVES[optimizer]
        writer = SummaryWriter(f"{dump}/tb/20261126-0000")
        for step in range(1, 7):
            wall = START + step * seconds_per_step
            writer.add_scalar("loss/train", 9.0 - step, step, walltime=wall)
            writer.add_scalar("tokens_seen", 4096 * step, step, walltime=wall)
            if step % 2 == 0:
                writer.add_scalar("loss/validation", losses[step // 2 - 1], step, walltime=wall + 0.3)
        writer.close()
        return subprocess.CompletedProcess(command, 0)

    return run


def test_tokens_and_seconds_to_the_loss_every_run_reaches(tmp_path, monkeypatch):
    bench = load_bench()
    launched = []
    monkeypatch.setattr(bench.subprocess, "run", fake_train_sh(launched))
    doc = tmp_path / "performance.md"
    argv = ["--workdir", str(tmp_path / "work"), "--val_freq", "2", "--val_steps", "3", "--doc", str(doc), "--",
            "--training.steps", "6"]  # fmt: skip
    assert bench.main(argv) == 0
    assert launched[1][:3] == ["NGPU=1", str(REPO / "train.sh"), "--job.dump_folder"]
    assert launched[1][4:] == ["--training.steps", "6", "--optimizer.name", "Muon", "--validation.enable",
                               "--validation.freq", "2", "--validation.steps", "3", "--checkpoint.no-enable"]  # fmt: skip
    section = doc.read_text().split("<!-- bench_tokens_to_loss -->")[1]
    # Target 3.5 (AdamW's last): AdamW at step 6, 5.3 s after its step 1; Muon at step 4, 4.8 s after its (slower) step 1.
    assert "| AdamW | 3.5000 | 6 | 24,576 | 5.3 | 1.00 |" in section
    assert "| Muon | 3.2000 | 4 | 16,384 | 4.8 | 0.67 |" in section
    assert "Target: validation loss 3.5000, the highest of the runs' last." in section
    assert "the job `NGPU=1 bash train.sh --training.steps 6` once per optimizer" in section


def test_a_failed_run_is_a_row_and_fails_the_exit_status(tmp_path, monkeypatch, capsys):
    bench = load_bench()
    monkeypatch.setattr(bench.subprocess, "run", fake_train_sh([]))
    argv = ["--optimizers", "Muon,Lion,AdamW", "--workdir", str(tmp_path), "--no_write"]
    assert bench.main(argv) == 1
    out = capsys.readouterr().out
    assert f"| Lion | failed: exit status 1; see {tmp_path / 'Lion.log'} | | | | |" in out
    # Target 3.5 (AdamW's last); Muon, the first row, reaches it at step 4.
    assert "| Muon | 3.2000 | 4 | 16,384 | 4.8 | 1.00 |" in out
    assert "| AdamW | 3.5000 | 6 | 24,576 | 5.3 | 1.50 |" in out
