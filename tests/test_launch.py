"""train.sh's pre-flight: fast one-line errors, --help, and the dry run (no ranks, no dump folder)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.trainer_helpers import dry_run_output

REPO = Path(__file__).resolve().parents[1]


def train_sh(*args, env=None, timeout=120):
    return subprocess.run(
        ["bash", str(REPO / "train.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def preflight_only(tmp_path, *args, env=None):
    """Run train.sh with a stub torchrun (FLAME_TORCHRUN=1: one process too) that leaves a mark: a refusal must come
    before any rank starts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "torchrun-started"
    stub = bin_dir / "torchrun"
    stub.write_text(f'#!/bin/sh\ntouch "{mark}"\n')
    stub.chmod(0o755)
    result = train_sh(
        *args,
        env={**(env or {}), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FLAME_TORCHRUN": "1"},
    )
    assert not mark.exists(), "the refusal came after torchrun started the ranks"
    return result


def test_unknown_option_fails_in_the_preflight_with_one_line(tmp_path):
    result = preflight_only(tmp_path, "--training.stepz", "3")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown option --training.stepz; did you mean 'training.steps'?"


def test_unknown_toml_key_fails_in_the_preflight(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[optimizer]\nlearning_rate = 1e-3\n")
    result = preflight_only(tmp_path, "--job.config_file", str(toml))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "unknown key 'optimizer.learning_rate'" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.config", "/nope.json"], "model config /nope.json does not exist"),
        (["--model.tokenizer_path", "/nope/tok"], "tokenizer path /nope/tok does not exist"),
    ],
)
def test_bad_paths_are_one_line(args, message):
    result = train_sh(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {message}" + result.stderr.strip().split(message, 1)[1]
    ]


def test_malformed_and_unknown_model_configs(tmp_path, monkeypatch, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"model_type": "transformer", ')
    result = train_sh("--model.config", str(bad_json))
    assert result.returncode == 2 and "is not valid JSON" in result.stderr
    from flame.launch import main

    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"model_type": "mamba9"}')
    monkeypatch.setattr("sys.argv", ["flame.launch", "--model.config", str(unknown)])
    capsys.readouterr()
    assert main() == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "model_type 'mamba9' is not supported" in line


def test_an_fla_class_without_a_gpu_stops_before_the_ranks_and_still_dry_runs(tmp_path, capsys):
    config = tmp_path / "gla.json"
    config.write_text('{"model_type": "gla", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2}')
    dump = tmp_path / "run"
    result = train_sh("--model.config", str(config), "--job.dump_folder", str(dump))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "error: model_type 'gla' is FLA's class, whose layers run Triton kernels only: it needs"
    )
    assert not (dump / "logs").exists()  # no rank started
    out = dry_run_output(capsys, "--model.config", str(config))
    assert re.search(r"^params: \d+$", out, re.M)


def test_tokenizer_larger_than_vocab_is_refused_or_resized(tmp_path, capsys):
    small = tmp_path / "small.json"
    config = json.loads((REPO / "flame/assets/tiny.json").read_text())
    small.write_text(json.dumps({**config, "vocab_size": 1000}))
    result = train_sh("--model.config", str(small))
    assert result.returncode == 2
    assert "the tokenizer has 4096 tokens but the model's vocab_size is 1000" in result.stderr
    out = dry_run_output(capsys, "--model.config", str(small), "--model.resize_vocab")
    assert json.loads(out[: out.index("params:")])["model"]["resize_vocab"] is True


def test_ngpu_above_visible_gpus_is_refused():
    from flame.errors import FlameError
    from flame.launch import check_devices

    check_devices(2, visible=2)
    with pytest.raises(FlameError, match=r"NGPU=3 but only 2 GPU\(s\) are visible; set NGPU <= 2"):
        check_devices(3, visible=2)
    check_devices(3, visible=0)  # no GPU: NGPU counts CPU processes


def test_help_lists_every_option_with_flame_docs():
    result = train_sh("--help")
    assert result.returncode == 0
    for text in (
        "--job.dry-run",
        "Build the model on the meta device",
        "--training.data-probs",
        "--model.config",
    ):
        assert text in result.stdout


def test_dry_run_prints_config_params_and_flops_without_touching_dump(tmp_path):
    dump = tmp_path / "dump"
    result = train_sh("--job.dry_run", "--job.dump_folder", str(dump))
    assert result.returncode == 0, result.stderr
    assert not dump.exists()
    params = int(re.search(r"^params: (\d+)$", result.stdout, re.M).group(1))
    flops = int(re.search(r"^flops_per_token: (\d+)$", result.stdout, re.M).group(1))
    assert 2_000_000 < params < 10_000_000  # the embedded default is a few million parameters
    assert flops > 6 * (params - 4096 * 256)
    merged = json.loads(result.stdout[: result.stdout.index("params:")])
    assert merged["job"]["dry_run"] is True and merged["job"]["dump_folder"] == str(dump)


def test_dry_run_counts_varlen_attention_over_one_document(tmp_path, capsys):
    """With --training.varlen no query attends past its document of at most context_len tokens: the attention
    terms count that span, as a run of context_len-token rows would."""

    def flops(*flags):
        out = dry_run_output(capsys, "--job.dump_folder", str(tmp_path), "--model.config",
                             str(REPO / "configs/transformer_340M.json"), *flags)  # fmt: skip
        return int(re.search(r"^flops_per_token: (\d+)$", out, re.M).group(1))

    row = ("--training.batch_size", "1", "--training.seq_len", "8192")
    rows = flops(*row)
    short_rows = flops("--training.seq_len", "1024")
    assert flops(*row, "--training.varlen", "--training.context_len", "1024") == short_rows
    assert short_rows < rows
    assert flops(*row, "--training.varlen") == rows  # documents as long as the row


def fla_transformer_param_count(config_path: Path, monkeypatch) -> int:
    """FLA's TransformerForCausalLM on the meta device (its Attention only checks that flash_attn imported; the
    placeholder is removed after the test, so that later tests see FLA as it is)."""
    import fla.layers.attn
    import torch
    from fla.models import TransformerConfig, TransformerForCausalLM

    monkeypatch.setattr(fla.layers.attn, "flash_attn_func", lambda *a, **k: None)
    config = TransformerConfig(**json.loads(config_path.read_text()))
    with torch.device("meta"):
        return sum(p.numel() for p in TransformerForCausalLM(config).parameters())


def test_dry_run_of_transformer_340m_matches_fla(monkeypatch, capsys):
    config = REPO / "configs/transformer_340M.json"
    out = dry_run_output(capsys, "--model.config", str(config), "--model.tokenizer_path",
                         str(REPO / "flame/assets/tokenizer"))  # fmt: skip
    params = int(re.search(r"^params: (\d+)$", out, re.M).group(1))
    assert params == fla_transformer_param_count(config, monkeypatch)
    assert 370_000_000 < params < 380_000_000


@pytest.mark.parametrize("preset, expected", [("", "1"), ("0", "0")])
def test_ranks_cache_triton_autotuning_unless_told_not_to(tmp_path, preset, expected):
    """train.sh hands torchrun TRITON_CACHE_AUTOTUNING=1 unless the caller set it (a stub torchrun prints it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "torchrun"
    stub.write_text('#!/bin/sh\necho "ranks see TRITON_CACHE_AUTOTUNING=$TRITON_CACHE_AUTOTUNING"\n')
    stub.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FLAME_EXPORT_HF": "0",
        "FLAME_TORCHRUN": "1",
        "TRITON_CACHE_AUTOTUNING": preset,  # empty counts as unset
    }
    result = train_sh("--job.dump_folder", str(tmp_path / "dump"), env=env)
    assert result.returncode == 0, result.stderr
    assert f"ranks see TRITON_CACHE_AUTOTUNING={expected}\n" in result.stdout


def test_context_len_over_seq_len_stops_in_the_preflight(tmp_path):
    result = preflight_only(
        tmp_path, "--training.context_len", "4096", "--training.seq_len", "256", env={"NGPU": "2"}
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: training.context_len (4096) must not exceed training.seq_len (256)"
    ]


@pytest.mark.parametrize(
    ("ngpu", "args", "message"),
    [
        (1, ["--training.varlen", "--training.batch_size", "2"], "training.batch_size must be 1, got 2"),
        (1, ["--training.dataset", "a,b", "--training.data_probs", "0.5"], "training.data_probs has 1 values"),
        (2, ["--training.global_batch_size", "12"], "training.global_batch_size 12 is not a multiple of local batch"),
        (2, ["--checkpoint.create_seed_checkpoint"], "create_seed_checkpoint runs on one process, not 2"),
        (1, ["--profiling.enable_memory_snapshot"], "enable_memory_snapshot records CUDA memory; it needs a GPU"),
        (8, ["--training.data_parallel_shard_degree", "3"], "= 3 is not the world size 8"),
    ],
)  # fmt: skip
def test_launch_contradictions_stop_in_the_preflight(monkeypatch, ngpu, args, message):
    from flame.errors import FlameError
    from flame.launch import VISIBLE_GPUS_ENV, preflight

    monkeypatch.setenv("NGPU", str(ngpu))
    monkeypatch.delenv("FLAME_LAUNCH_ENV", raising=False)
    monkeypatch.setenv(VISIBLE_GPUS_ENV, "0")
    with pytest.raises(FlameError, match=re.escape(message)):
        preflight(args)


def test_a_global_batch_the_ranks_can_split_passes_the_preflight(monkeypatch):
    from flame.launch import preflight

    monkeypatch.setenv("NGPU", "2")
    monkeypatch.delenv("FLAME_LAUNCH_ENV", raising=False)
    assert preflight(["--training.global_batch_size", "32"]) == 0  # 8 x 2 ranks x 2 accumulation steps


def test_one_node_launches_on_a_free_port_unless_told(monkeypatch, tmp_path):
    """The pre-flight hands train.sh a port nobody holds on one node (two jobs on a machine never meet on
    torchrun's default); MASTER_PORT given, or several nodes, and train.sh keeps the given port or 29500."""
    import socket

    from flame.launch import preflight

    env_file = tmp_path / "env"
    monkeypatch.setenv("FLAME_LAUNCH_ENV", str(env_file))
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("NNODE", raising=False)

    def port_line() -> list[str]:
        return [line for line in env_file.read_text().splitlines() if line.startswith("MASTER_PORT=")]

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        ports = set()
        for run in range(3):
            assert preflight(["--job.dump_folder", str(tmp_path / f"run{run}")]) == 0
            (line,) = port_line()
            ports.add(int(line.split("=")[1]))
        assert held.getsockname()[1] not in ports
    for name, value in (("MASTER_PORT", "29611"), ("NNODE", "2")):
        monkeypatch.setenv(name, value)
        assert preflight(["--job.dump_folder", str(tmp_path / name)]) == 0
        assert port_line() == []
        monkeypatch.delenv(name)


LEFT_TO_THE_RANKS = ("datasets", "flame.data.loader", "torch._dynamo", "triton", "torch.distributed.tensor")


@pytest.mark.parametrize(
    "config",
    ["configs/transformer_340M.json", "configs/gated_deltanet_340M.json", "configs/delta_net_340M.json",
     "configs/olmo_1b_hybrid_gated_deltanet_pp.json"],
)  # fmt: skip
def test_the_preflight_of_flames_families_imports_no_torch(config, tmp_path):
    """torch's import is most of a pre-flight (~1 s on this repository's CPU machine, ~5 s on a GPU host): the
    checks of a job on flame's own families run without it, given train.sh's GPU count (FLAME_VISIBLE_GPUS)."""
    code = (
        "import sys; from flame.launch import preflight; "
        f"status = preflight(['--model.config', '{config}', '--job.dump_folder', '{tmp_path}']); "
        "print(status, 'torch' in sys.modules)"
    )
    env = {**os.environ, "FLAME_VISIBLE_GPUS": "1", "FLAME_LAUNCH_ENV": str(tmp_path / "env")}
    result = subprocess.run(
        ["python", "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, env=env
    )
    assert result.stdout.split() == ["0", "False"], result.stderr


def test_the_preflight_counts_gpus_without_torch_given_train_sh_s_count_or_no_driver(monkeypatch):
    from flame import launch

    code = "import sys; from flame.launch import visible_gpus; print(visible_gpus(), 'torch' in sys.modules)"
    env = {**os.environ, "FLAME_VISIBLE_GPUS": "3"}
    result = subprocess.run(
        ["python", "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60, env=env
    )
    assert result.stdout.split() == ["3", "False"], result.stderr
    monkeypatch.delenv("FLAME_VISIBLE_GPUS", raising=False)
    monkeypatch.setattr(launch, "NVIDIA_DRIVER", Path("/nonexistent/driver/nvidia"))
    assert launch.visible_gpus() == 0


def test_train_sh_hands_the_preflight_and_the_ranks_nvidia_smi_s_gpu_count(tmp_path, monkeypatch):
    """With nvidia-smi present (a stub listing two GPUs), train.sh exports its count for the pre-flight; a stub
    torchrun prints what the ranks would see."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: A (UUID: a)'\necho 'GPU 1: B (UUID: b)'\n")
    (bin_dir / "torchrun").write_text('#!/bin/sh\necho "NGPU=$NGPU FLAME_VISIBLE_GPUS=$FLAME_VISIBLE_GPUS"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FLAME_EXPORT_HF": "0", "FLAME_PREWARM": "0",
           "FLAME_TORCHRUN": "1"}  # fmt: skip
    monkeypatch.delenv("NGPU", raising=False)  # train.sh's default: the GPUs it counted
    result = train_sh("--job.dump_folder", str(tmp_path / "dump"), env=env)
    assert result.returncode == 0, result.stderr
    assert "NGPU=2 FLAME_VISIBLE_GPUS=2\n" in result.stdout


def test_the_preflight_imports_none_of_what_only_the_ranks_need():
    """flame.data's loader imports datasets and torch._dynamo takes ~4 s cold on a GPU host; Triton (flame's and FLA's
    kernels) and DTensor (parallel models; with sympy ~0.7 s on this repository's CPU machine) serve only the ranks:
    a launch's pre-flight checks the job, the model config included, without any of them. (A dry run's model on the
    meta device initializes through torch._refs, which imports dynamo.)"""
    code = (
        "import sys; from flame.launch import preflight; "
        "preflight(['--model.config', 'configs/gated_deltanet_340M.json']); "
        f"print([name for name in {LEFT_TO_THE_RANKS!r} if name in sys.modules])"
    )
    result = subprocess.run(["python", "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stderr


def test_print_args_prints_the_merged_config_before_the_ranks(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/bin/sh\necho ranks start\n")
    (bin_dir / "torchrun").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FLAME_EXPORT_HF": "0",
        "FLAME_TORCHRUN": "1",
    }
    result = train_sh("--job.print_args", "--job.dump_folder", str(tmp_path / "dump"), env=env)
    assert result.returncode == 0, result.stderr
    printed, _, after = result.stdout.partition("ranks start")
    assert json.loads(printed)["job"]["print_config"] is True and after == "\n"


def stub_torchrun(tmp_path: Path, body: str) -> dict:
    """PATH with a torchrun that runs ``body`` (bash; $LOG_DIR is its --log-dir), for train.sh's handling of it;
    FLAME_TORCHRUN=1 launches one node's ranks through it too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "torchrun"
    stub.write_text(
        '#!/usr/bin/env bash\nwhile [ $# -gt 0 ]; do [ "$1" = --log-dir ] && LOG_DIR=$2; shift; done\n' + body
    )
    stub.chmod(0o755)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FLAME_EXPORT_HF": "0",
        "FLAME_TORCHRUN": "1",
    }


LAUNCHER_FAILURE = (
    'echo "[rank0]:[titan] starting" >&2\n'
    'echo "Traceback (most recent call last):" >&2\n'
    'echo "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:" >&2\n'
    'echo "  exitcode  : -9 (pid: 4242)" >&2\n'
    "exit 1\n"
)


def test_a_refusal_of_a_rank_the_console_hides_is_the_last_line(tmp_path):
    dump = tmp_path / "dump"
    body = 'mkdir -p "$LOG_DIR/none_x/attempt_0/1"\necho "error: rank 1 refuses" > "$LOG_DIR/none_x/attempt_0/1/stderr.log"\n'
    result = train_sh(
        "--job.dump_folder", str(dump), env={**stub_torchrun(tmp_path, body + LAUNCHER_FAILURE), "NGPU": "2"}
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["[rank0]:[titan] starting", "[rank1]:error: rank 1 refuses"]
    assert "ChildFailedError" in (dump / "logs" / "launcher.log").read_text()


def test_a_rank_ending_without_a_message_gets_one_line_naming_the_reports(tmp_path):
    dump = tmp_path / "dump"
    result = train_sh("--job.dump_folder", str(dump), env=stub_torchrun(tmp_path, LAUNCHER_FAILURE))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "[rank0]:[titan] starting",
        "error: training failed: a rank ended with exit code -9 without a message (killed, out of memory or "
        f"crashed); every rank's output is in {dump}/logs, the launcher's report in {dump}/logs/launcher.log",
    ]


def test_a_rank_that_raised_ends_the_output_on_its_exception(tmp_path):
    """A crash's traceback goes to the rank's log; the last line names the exception (the last of the traceback's
    "Type: message" lines, without the rank prefix torch's excepthook adds) and where the traceback is."""
    dump = tmp_path / "dump"
    traceback = tmp_path / "traceback.log"
    traceback.write_text(
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "step.py", line 3, in run\n'
        "[rank1]: KeyError: 'first'\n"
        "[rank1]: During handling of the above exception, another exception occurred:\n"
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "[rank1]: Debugging:\n"
        "[rank1]: - Set PYTORCH_CUDA_ALLOC_CONF\n"
    )
    body = (
        'mkdir -p "$LOG_DIR/none_x/attempt_0/0" "$LOG_DIR/none_x/attempt_0/1"\n'
        'echo "[rank0]:[titan] step 1" > "$LOG_DIR/none_x/attempt_0/0/stderr.log"\n'
        f'cp "{traceback}" "$LOG_DIR/none_x/attempt_0/1/stderr.log"\n'
    )
    raised = body + LAUNCHER_FAILURE.replace("-9", "1")
    result = train_sh("--job.dump_folder", str(dump), env={**stub_torchrun(tmp_path, raised), "NGPU": "2"})
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "error: training failed: rank 1 raised torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 "
        f"GiB; its traceback is in {dump}/logs/none_x/attempt_0/1/stderr.log, the launcher's report in "
        f"{dump}/logs/launcher.log"
    )
    # Launched again into the same dump folder, a rank killed by a signal: this launch's report counts (launcher.log
    # holds both), and the exception in a rank's log is not what ended the run.
    (tmp_path / "killed").mkdir()
    killed = train_sh(
        "--job.dump_folder",
        str(dump),
        env={**stub_torchrun(tmp_path / "killed", body + LAUNCHER_FAILURE), "NGPU": "2"},
    )
    assert killed.stderr.splitlines()[-1].startswith(
        "error: training failed: a rank ended with exit code -9 without a message"
    )


@pytest.mark.slow
def test_under_torchrun_a_rank_refusal_is_the_last_line_without_launcher_traceback(tmp_path):
    """Two CPU ranks refuse an unreadable dataset: the refusal ends the output, torchrun's report is in the log."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "part.parquet").write_text("not parquet")
    dump = tmp_path / "dump"
    result = train_sh(
        "--training.dataset", str(data), "--job.dump_folder", str(dump), "--training.steps", "30",
        env={"NGPU": "2", "FLAME_EXPORT_HF": "0", "FLAME_TORCHRUN": "1"}, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    # Both ranks refuse the same file; whichever wrote its line last ends the output, and its log ends with it (the
    # first rank to fail stops the other, which may not have reached its refusal).
    refusal = re.match(
        r"\[rank([01])\]:(error: cannot read data file '.*part.parquet'.*)", result.stderr.splitlines()[-1]
    )
    assert refusal, result.stderr
    (stderr_log,) = (dump / "logs").glob(f"*/attempt_0/{refusal.group(1)}/stderr.log")
    assert stderr_log.read_text().splitlines()[-1] == refusal.group(2)
    assert "Traceback" not in result.stderr + result.stdout and "ChildFailedError" not in result.stderr
    assert "ChildFailedError" in (dump / "logs" / "launcher.log").read_text()


@pytest.mark.slow
def test_one_nodes_ranks_start_without_torchrun_and_a_rank_refusal_is_the_last_line(tmp_path):
    """NGPU=2 on one node: flame.launch_local starts the ranks (a stub torchrun would leave a mark), which meet through
    rank 0; a refusal ends the output, the launcher's report with the exit code is in the log, and the ranks' files
    are where torchrun keeps them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "torchrun-started"
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\ntouch "{mark}"\nexit 1\n')
    (bin_dir / "torchrun").chmod(0o755)
    data = tmp_path / "data"
    data.mkdir()
    (data / "part.parquet").write_text("not parquet")
    dump = tmp_path / "dump"
    env = {"NGPU": "2", "FLAME_EXPORT_HF": "0", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = train_sh("--training.dataset", str(data), "--job.dump_folder", str(dump), env=env, timeout=300)
    assert not mark.exists()
    assert result.returncode == 1
    # Both ranks refuse the same file; whichever wrote its line last ends the output, and its log ends with it (the
    # first rank to fail stops the other, which may not have reached its refusal).
    refusal = re.match(
        r"\[rank([01])\]:(error: cannot read data file '.*part.parquet'.*)", result.stderr.splitlines()[-1]
    )
    assert refusal, result.stderr
    assert "exitcode : 2;" in (dump / "logs" / "launcher.log").read_text()
    (stderr_log,) = (dump / "logs").glob(f"none_*/attempt_0/{refusal.group(1)}/stderr.log")
    assert stderr_log.read_text().splitlines()[-1] == refusal.group(2)
