"""The metrics logger (console line, TensorBoard, W&B offline) and the FLOPs per token behind MFU."""

import importlib.util
import re
import time

import pytest
import torch

from flame.config import parse_args
from flame.config.checks import validate_job
from flame.errors import ConfigError
from flame.metrics import MetricsLogger
from flame.models.common.flops import chunked_delta_rule_flops_per_token
from tests.trainer_helpers import tensorboard_scalars

STEP_METRICS = {"loss/train": 5.25, "grad_norm": 0.5, "lr": 3e-4, "skipped_steps": 2, "tokens_seen": 4096.0}


def test_console_line_tensorboard_and_mfu(tmp_path, caplog):
    config = parse_args(["--job.dump_folder", str(tmp_path)])
    metrics = MetricsLogger(config, torch.device("cpu"), rank=0, flops_per_token=1000, last_step=20)
    metrics.peak_flops = 1e6  # as on a GPU with a known peak
    metrics.tokens = 2048
    with caplog.at_level("INFO"):
        metrics.log(10, dict(STEP_METRICS))
        metrics.log_validation(
            10, {"loss/validation": 5.0, "perplexity/validation": 148.4, "validation/tokens": 512}, 1.0
        )
    metrics.close()
    line = next(r.message for r in caplog.records if r.message.startswith("step"))
    assert re.fullmatch(
        r"step 10/20  loss  5\.2500  grad_norm   0\.500  lr 3\.00e-04  tok/s [\d,]+  mfu +[\d.]+%  "
        r"mem [\d.]+GiB  data 0%  skipped 2  eta \d+:\d\d:\d\d",
        line,
    ), line
    assert "validation at step 10: loss 5.0000  perplexity 148.40  (512 tokens, 1.0s)" in caplog.text
    tokens_per_second = tensorboard_scalars(tmp_path, "throughput/tokens_per_second_per_device")[10]
    mfu = tensorboard_scalars(tmp_path, "throughput/mfu_percent")[10]
    assert mfu == pytest.approx(100 * 1000 * tokens_per_second / 1e6, rel=1e-5)
    for tag in ("loss/train", "grad_norm", "lr", "skipped_steps", "tokens_seen", "memory/peak_allocated_gib",
                "memory/peak_reserved_gib", "throughput/data_loading_share", "loss/validation"):  # fmt: skip
        assert 10 in tensorboard_scalars(tmp_path, tag), tag


def test_a_line_written_a_step_late_measures_up_to_the_end_of_its_step(tmp_path):
    """The trainer writes a log step's line while the next step runs (the last step's at once): each line's window
    runs from the end of the step last logged to the end of its own, whenever it is written."""
    config = parse_args(["--job.dump_folder", str(tmp_path), "--metrics.log_freq", "1",
                         "--metrics.no-enable-tensorboard"])  # fmt: skip
    metrics = MetricsLogger(config, torch.device("cpu"), rank=0, flops_per_token=1, last_step=3)
    written = {}

    def write(step):
        written[step] = dict(STEP_METRICS)
        metrics.log(step, written[step])

    step_seconds = 0.05
    for step in (1, 2, 3):
        time.sleep(step_seconds)  # the step's work (on the CPU, done when the step returns)
        metrics.end_step(step, tokens=100, data_seconds=0.01)
        if step == 1:
            write(1)
        if step == 3:
            write(2)  # read back once step 3 is queued
            write(3)  # the last step: at once
    for step, line in written.items():
        tokens_per_second = line["throughput/tokens_per_second_per_device"]
        assert 100 / (5 * step_seconds) < tokens_per_second <= 100 / step_seconds, (step, tokens_per_second)
        assert 0 < line["throughput/data_loading_share"] <= 0.01 / step_seconds, step


def test_only_rank_zero_writes(tmp_path):
    config = parse_args(["--job.dump_folder", str(tmp_path)])
    assert MetricsLogger(config, torch.device("cpu"), rank=1, flops_per_token=1, last_step=5).writers == []
    assert not (tmp_path / "tb").exists()


def test_wandb_offline_run_is_written_under_the_dump_folder(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = parse_args(["--job.dump_folder", str(tmp_path / "run"), "--metrics.enable_wandb",
                         "--metrics.no-enable-tensorboard"])  # fmt: skip
    metrics = MetricsLogger(config, torch.device("cpu"), rank=0, flops_per_token=1, last_step=5)
    metrics.tokens = 100
    metrics.log(1, dict(STEP_METRICS))
    metrics.log_samples(1, [("The", " end")])
    metrics.close()
    # finish() can return before wandb's service process has flushed the run file; the service's
    # exit (what ends a training process) closes it.
    wandb.teardown()
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = run.read_bytes()  # the run's records, for `wandb sync`; the keys and values appear as text
    for text in (
        b"loss/train",
        b"5.25",
        b"grad_norm",
        b"throughput/tokens_per_second_per_device",
        b"dump_folder",
    ):
        assert text in records, text
    assert list(run.parent.glob("files/media/html/samples/*.html"))


def test_wandb_enabled_but_not_installed_is_one_line(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError) as info:
        validate_job(parse_args(["--metrics.enable_wandb"]))
    assert str(info.value) == (
        "metrics.enable_wandb needs the wandb package: pip install 'flame[wandb]' (or pip install wandb)"
    )


def test_chunked_delta_rule_flops_formula():
    # K = V = 128, C = 64: 4C(K+V) + 2CK + C^2/3 + 6KV forward, x3.
    assert chunked_delta_rule_flops_per_token(128, 128) == 3 * (65536 + 16384 + 1365 + 98304)


def flops(config: dict, seq_len: int = 2048) -> tuple[int, int]:
    from flame.models import build_model, get_model_spec

    args, _ = get_model_spec(config["model_type"]).args_cls.from_dict(config)
    with torch.device("meta"):
        model = build_model(args)
    return args.get_nparams_and_flops(model, seq_len)


BASE = {"vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 4}


@pytest.mark.parametrize(
    ("config", "per_layer"),
    [
        # Gated DeltaNet: the op runs per value head (q/k shared across a group), K = head_dim, V = expand_v x K.
        ({"model_type": "gated_deltanet", "num_heads": 2, "head_dim": 64, "expand_v": 2},
         2 * chunked_delta_rule_flops_per_token(64, 128)),
        ({"model_type": "gated_deltanet", "num_heads": 2, "num_v_heads": 4, "head_dim": 64, "expand_v": 1},
         4 * chunked_delta_rule_flops_per_token(64, 64)),
        ({"model_type": "delta_net", "num_heads": 4}, 4 * chunked_delta_rule_flops_per_token(64, 64)),
        # Softmax attention: 12 x heads x head_dim x seq_len.
        ({"model_type": "transformer", "num_heads": 4}, 12 * 256 * 2048),
    ],
)  # fmt: skip
def test_flops_per_token_count_each_familys_mixer(config, per_layer):
    nparams, total = flops({**BASE, **config})
    assert total == 6 * (nparams - 1000 * 256) + 4 * per_layer


def test_hybrid_flops_sum_attention_and_linear_layers():
    gdn = {**BASE, "model_type": "gated_deltanet", "num_heads": 2, "head_dim": 64, "expand_v": 2}
    nparams, total = flops({**gdn, "attn": {"layers": [1, 3], "num_heads": 4}})
    linear = 2 * chunked_delta_rule_flops_per_token(64, 128)
    assert total == 6 * (nparams - 1000 * 256) + 2 * 12 * 256 * 2048 + 2 * linear
    # At 2048 tokens a linear-attention layer costs less than an attention layer.
    assert linear < 12 * 256 * 2048


def test_upstream_flames_metric_names_are_written_too(tmp_path):
    from flame.metrics import RANK_LOSS

    config = parse_args(["--job.dump_folder", str(tmp_path)])
    metrics = MetricsLogger(config, torch.device("cpu"), rank=0, flops_per_token=1000, last_step=20)
    metrics.peak_flops = 1e6
    metrics.tokens = 2048
    metrics.data_seconds = 0.0
    metrics.log(10, {**STEP_METRICS, RANK_LOSS: 5.5})
    metrics.close()

    def scalar(tag):
        return tensorboard_scalars(tmp_path, tag).get(10)

    tokens_per_second = scalar("throughput/tokens_per_second_per_device")
    assert scalar("loss_metrics/global_avg_loss") == 5.25 and scalar("loss_metrics/global_max_loss") == 5.5
    assert scalar("grad_norm") == 0.5 and scalar("lr") == pytest.approx(3e-4)
    assert scalar("throughput(tps)") == tokens_per_second
    assert scalar("tflops") == pytest.approx(1000 * tokens_per_second / 1e12, rel=1e-5)
    assert scalar("mfu(%)") == scalar("throughput/mfu_percent")
    assert scalar("memory/max_reserved(GiB)") == scalar("memory/peak_reserved_gib")
    assert scalar("memory/max_active(GiB)") == scalar("memory/peak_allocated_gib")
    assert scalar("time_metrics/data_loading(%)") == 0.0
    assert scalar(RANK_LOSS) is None  # an input of the max, not a metric


def max_of_two_ranks(rank: int, port: int, results) -> None:
    from flame.metrics import max_over_ranks

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=2
    )
    results[rank] = max_over_ranks([4.0, 6.5][rank], torch.device("cpu"))
    torch.distributed.destroy_process_group()


def test_max_loss_is_the_largest_rank_mean_of_all_ranks():
    from tests.trainer_helpers import free_port

    results = torch.multiprocessing.Manager().dict()
    torch.multiprocessing.spawn(max_of_two_ranks, args=(free_port(), results), nprocs=2)
    assert dict(results) == {0: 6.5, 1: 6.5}


def test_the_trainer_hands_each_ranks_own_mean_loss(make_trainer):
    """One rank: its own mean loss is the global one (the max over ranks of one rank is its value)."""
    from flame.metrics import RANK_LOSS

    trainer = make_trainer()
    logged = []
    original = trainer.metrics.log
    trainer.metrics.log = lambda step, metrics: (logged.append(dict(metrics)), original(step, metrics))
    trainer.step = 1
    trainer.train_step(iter(trainer.batches))
    assert logged[0][RANK_LOSS] == pytest.approx(logged[0]["loss/train"], rel=1e-6)
