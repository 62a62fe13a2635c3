"""scripts/readme_commands.py (the README's commands as short trials, for the 8-GPU run) on 2 CPU ranks: the first
command as pasted, a tiny model appended, trains, uploads each checkpoint to the stand-in hub, resumes from its first
checkpoint to the same weights bit for bit, exports a folder transformers loads, and the table says so."""

import os
import subprocess
import sys

import pytest

from tests.config.test_upstream import COMMANDS
from tests.parallelize.test_bench_throughput import REPO, rows

pytestmark = pytest.mark.slow

TINY = ["--model.config", "flame/assets/tiny.json", "--training.seq_len", "64", "--training.context_len", "64",
        "--training.batch_size", "2",
        "--training.num_workers", "0"]  # fmt: skip


def test_the_first_command_trains_resumes_exactly_uploads_and_exports_on_two_ranks(tmp_path):
    doc = tmp_path / "performance.md"
    command = [sys.executable, str(REPO / "scripts" / "readme_commands.py"), "--ngpu", "2", "--only", "0",
               "--steps", "2", "--interval", "1", "--workdir", str(tmp_path / "work"), "--doc", str(doc), "--", *TINY]  # fmt: skip
    # HF_HUB_OFFLINE as the test suite sets it (tests/data/conftest.py): the stand-in hub is reached anyway.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = doc.read_text()
    section = text[
        text.index("<!-- readme_commands_2gpu_0 -->") : text.index("<!-- /readme_commands_2gpu_0 -->")
    ]
    assert "The README's commands on 2 CPU ranks" in section
    [row] = rows(section)
    assert row[:2] == ["1", "configs/vanilla_transformer_340M.json"]
    assert row[4] == "equal" and row[5].startswith("yes (")
    assert row[6] == "steps 1, 2 in zaydzuhri/vanilla-340M-4096-batch16-steps100000" and row[7] == "none"
    # The run was the README's line with NGPU=2 and the trial's flags appended.
    launched = (tmp_path / "work" / "0" / "full.log").read_text().splitlines()[0]
    assert launched.startswith(COMMANDS[0].replace("NGPU=8 ", "NGPU=2 ", 1) + " --model.tokenizer_path ")


def test_a_failing_command_is_a_row_with_its_log_and_a_nonzero_exit(tmp_path):
    command = [sys.executable, str(REPO / "scripts" / "readme_commands.py"), "--ngpu", "2", "--only", "0",
               "--steps", "2", "--interval", "1", "--workdir", str(tmp_path), "--no_write", "--",
               "--model.config", str(tmp_path / "missing.json")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 1
    assert f"run 1 ended with status 2; see {tmp_path / '0' / 'full.log'}" in result.stdout
