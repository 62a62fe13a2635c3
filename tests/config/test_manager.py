"""Job config parsing: TOML + flags precedence, flame's aliases, and one-line errors for mistakes."""

import pytest

from flame.config import parse_args
from flame.errors import ConfigError


def write_toml(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_point_at_the_embedded_job():
    config = parse_args([])
    assert config.model.config.endswith("flame/assets/tiny.json")
    assert config.checkpoint.enable and config.metrics.enable_tensorboard
    assert config.job.custom_config_module == "flame.config.job_config"


def test_flags_override_toml_which_overrides_defaults(tmp_path):
    toml = write_toml(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    config = parse_args(["--job.config_file", toml, "--training.steps", "9"])
    assert config.training.steps == 9  # flag beats TOML
    assert config.training.seq_len == 64  # TOML beats default
    assert config.optimizer.lr == 0.5


def test_flame_aliases_set_torchtitan_fields():
    config = parse_args(
        [
            "--training.batch_size", "3",
            "--training.compile",
            "--training.seed", "79",
            "--lr_scheduler.lr_min", "0.1",
            "--training.num_workers", "4",
            "--training.data_parallel_shard_degree", "2",
        ]
    )  # fmt: skip
    assert config.training.local_batch_size == 3
    assert config.compile.enable is True
    assert config.debug.seed == 79
    assert config.lr_scheduler.min_lr_factor == 0.1
    assert config.training.dataloader.num_workers == 4
    assert config.parallelism.data_parallel_shard_degree == 2


def test_flame_user_flags_from_the_seed_commands_parse():
    # The softpick paper's command line (seed 003), minus hub-only options.
    argv = [
        "--optimizer.name",
        "AdamW",
        "--optimizer.eps",
        "1e-15",
        "--optimizer.lr",
        "3e-4",
        "--lr_scheduler.warmup_steps",
        "1000",
        "--lr_scheduler.lr_min",
        "0.1",
        "--lr_scheduler.decay_type",
        "cosine",
        "--training.batch_size",
        "16",
        "--training.seq_len",
        "4096",
        "--training.context_len",
        "4096",
        "--training.gradient_accumulation_steps",
        "1",
        "--training.steps",
        "100000",
        "--training.max_norm",
        "1.0",
        "--training.skip_nan_inf",
        "--training.dataset_split",
        "train",
        "--training.num_workers",
        "32",
        "--training.prefetch_factor",
        "2",
        "--training.seed",
        "79",
        "--training.compile",
        "--checkpoint.interval",
        "10000",
        "--checkpoint.load_step",
        "-1",
        "--metrics.log_freq",
        "5",
        "--comm.init_timeout_seconds",
        "600",
        "--training.varlen",
        "--training.streaming",
        "--training.dataset_name",
        "sample-100BT",
        "--checkpoint.keep_latest_k",
        "2",
    ]
    config = parse_args(argv)
    assert config.optimizer.eps == 1e-15 and config.training.skip_nan_inf and config.training.varlen
    assert config.training.dataloader.prefetch_factor == 2 and config.checkpoint.load_step == -1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--training.batchsize", "3"],
            "unknown option --training.batchsize; did you mean 'training.batch_size'?",
        ),
        (["--trainng.steps", "3"], "did you mean 'training.steps'?"),
        (["--training.steps", "abc"], "--training.steps takes an integer, got 'abc'"),
        (["--optimizer.lr", "fast"], "--optimizer.lr takes a number, got 'fast'"),
        (["--activation_checkpoint.mode", "half"], "--activation_checkpoint.mode must be one of"),
        (
            ["--model.attention_backend", "flash_3"],
            "--model.attention_backend must be one of auto, fla, flash, cudnn, reference, got 'flash_3'",
        ),
        (["--training.seq_len"], "option --training.seq_len needs a value"),
        (["--job.config_file", "/nonexistent.toml"], "job config file /nonexistent.toml does not exist"),
    ],
)
def test_mistakes_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_toml_key_names_the_key_and_the_nearest(tmp_path):
    toml = write_toml(tmp_path, "[training]\nsteps = 7\nseqlen = 64\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'training.seqlen' in .*job.toml; did you mean 'training.seq_len'\?"
    ):
        parse_args(["--job.config_file", toml])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[model]\nimpl = "bogus"\n', "'model.impl' in {} must be one of auto, flame, fla, hf, got 'bogus'"),
        ('[model]\nattention_backend = "flash_3"\n',
         "'model.attention_backend' in {} must be one of auto, fla, flash, cudnn, reference, got 'flash_3'"),
        ('[training]\nsteps = "abc"\n', "'training.steps' in {} takes an integer, got 'abc'"),
        ("[training]\nsteps = 1e5\n", "'training.steps' in {} takes an integer, got 100000.0"),
        ("[training]\nseq_len = true\n", "'training.seq_len' in {} takes an integer, got True"),
        ('[optimizer]\nlr = "fast"\n', "'optimizer.lr' in {} takes a number, got 'fast'"),
        ("[training]\nvarlen = 1\n", "'training.varlen' in {} takes true or false, got 1"),
        ('[compile]\ncomponents = "model"\n', "'compile.components' in {} takes a list, got 'model'"),
        ("[training]\ndataset = 3\n", "'training.dataset' in {} takes a string, got 3"),
    ],
)  # fmt: skip
def test_a_toml_value_of_the_wrong_type_is_one_line(tmp_path, text, message):
    # tyro checks flags; TOML values become its defaults, which it does not check.
    toml = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        parse_args(["--job.config_file", toml])
    assert str(info.value) == message.format(toml)


def test_toml_values_that_fit_their_options_parse(tmp_path):
    toml = write_toml(tmp_path, '[training]\nmax_norm = 1\nsteps = 7\n[compile]\ncomponents = ["model"]\n'
                                '[model]\nattention_backend = "cudnn"\n')  # fmt: skip
    config = parse_args(["--job.config_file", toml])
    assert (config.training.max_norm, config.training.steps) == (1, 7)
    assert config.compile.components == ["model"] and config.model.attention_backend == "cudnn"


def test_unknown_toml_section(tmp_path):
    toml = write_toml(tmp_path, "[trainer]\nsteps = 7\n")
    with pytest.raises(ConfigError, match="unknown key 'trainer'.*did you mean 'training'"):
        parse_args(["--job.config_file", toml])


def test_malformed_toml(tmp_path):
    toml = write_toml(tmp_path, "[training\nsteps = 7\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        parse_args(["--job.config_file", toml])


def test_negated_switches_are_valid():
    assert parse_args(["--checkpoint.no-enable"]).checkpoint.enable is False
    with pytest.raises(ConfigError, match="unknown option --training.no-steps"):
        parse_args(["--training.no-steps"])
