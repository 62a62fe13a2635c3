"""Upstream flame's commands and options (tests/config/upstream_readme.md, verbatim from the softpick fork's README):
the training commands dry-run as pasted, and every option of its `train.sh -h` listing is accepted and either
changes a field flame uses or prints a notice that it has no effect."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flame.config import parse_args
from flame.config.job_config import ALIASES, NO_EFFECT, UpstreamJobConfig
from flame.config.manager import job_config_class, upstream_notices, valid_options
from flame.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
README = (Path(__file__).parent / "upstream_readme.md").read_text()


def readme_commands() -> list[str]:
    """The README's train.sh command lines (scripts/readme_commands.py reads them for its trials)."""
    spec = importlib.util.spec_from_file_location("readme_commands", REPO / "scripts" / "readme_commands.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.readme_commands()


def listing() -> list[tuple[str, str | None]]:
    """(option, metavar or {choices} or None for a switch) for every option of the -h listing but -h itself."""
    usage = README[README.index("options:") : README.index("</details>")]
    return [
        (name, meta or None)
        for name, meta in re.findall(r"^  (--[\w.]+)(?: ([A-Z0-9_.]+|\{[\w,]+\}))?", usage, re.M)
        if name != "--help"
    ]


COMMANDS = readme_commands()


def test_the_excerpt_holds_the_readme_commands_and_listing():
    assert len(COMMANDS) == 5 and all("--job.config_file flame/models/fla.toml" in c for c in COMMANDS)
    assert len(listing()) == 85  # -h aside


NGPUS = (1, 8)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[tuple[int, int], tuple[subprocess.CompletedProcess, Path]]:
    """Every README command dry-run with NGPU=1 and NGPU=8, two at a time (each is one CPU-bound process), each with
    its own HOME: {(index, ngpu): (result, HOME)}."""

    keys = [(index, ngpu) for index in range(len(COMMANDS)) for ngpu in NGPUS]
    # Made here, not in the threads: tmp_path_factory is not thread-safe (two threads creating a worker's first
    # temporary folder at once collide).
    homes = {(index, ngpu): tmp_path_factory.mktemp(f"home{index}_{ngpu}") for index, ngpu in keys}

    def dry_run(index: int, ngpu: int) -> tuple[subprocess.CompletedProcess, Path]:
        home = homes[index, ngpu]
        command = re.sub(r"^NGPU=8 ", "", COMMANDS[index])
        result = subprocess.run(
            ["bash", "-c", f"{command} --job.dry_run"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env={**os.environ, "NGPU": str(ngpu), "HOME": str(home)},
        )
        return result, home

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(keys, pool.map(lambda key: dry_run(*key), keys), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("ngpu", NGPUS)
@pytest.mark.parametrize("index", range(len(COMMANDS)))
def test_readme_command_dry_runs_verbatim(index, ngpu, dry_runs):
    result, tmp_path = dry_runs[index, ngpu]
    assert result.returncode == 0, result.stderr
    # Every option of the commands acts (the softpick commands' hub upload too): no notice.
    assert [line for line in result.stderr.splitlines() if line.startswith("notice:")] == []
    world = re.search(r"^world_size: (\d+) \(dp_replicate 1, dp_shard (\d+),", result.stdout, re.M)
    assert world.groups() == (str(ngpu), str(ngpu))
    merged = json.loads(result.stdout[: result.stdout.index("params:")])
    assert merged["model"]["tokenizer_path"] == "fla-hub/transformer-1.3B-100B"
    assert merged["optimizer"]["eps"] == 1e-15 and merged["lr_scheduler"]["min_lr_factor"] == 0.1
    assert merged["compile"]["enable"] is True and merged["training"]["skip_nan_inf"] is True
    if index < 4:  # the softpick commands
        assert merged["training"]["local_batch_size"] == 16 and merged["training"]["seq_len"] == 4096
        assert merged["debug"]["seed"] == 79 and merged["comm"]["init_timeout_seconds"] == 600
        assert merged["training"]["dataset"] == f"{tmp_path}/.cache/HuggingFaceFW___fineweb-edu/sample-100BT"
        assert merged["checkpoint"]["keep_latest_k"] == 0  # upstream's default: keep every checkpoint
        assert (
            merged["checkpoint"]["hf_upload_enabled"] is True
            and merged["checkpoint"]["hf_upload_format"] == "dcp"
        )
        assert merged["checkpoint"]["hf_repo_base_name"].startswith("zaydzuhri/")
    else:
        assert merged["training"]["varlen"] is True and merged["training"]["context_len"] == 4096
        assert merged["training"]["streaming"] is True and merged["checkpoint"]["keep_latest_k"] == 2


# A value for every option of the listing that takes one, different from flame's default.
VALUES = {
    "--job.config_file": "flame/models/fla.toml",
    "--job.dump_folder": "exp/walk",
    "--job.description": "walk",
    "--model.config": "configs/transformer_340M.json",
    "--model.norm_type": "rmsnorm",
    "--model.tokenizer_path": "fla-hub/transformer-1.3B-100B",
    "--profiling.save_traces_folder": "traces",
    "--profiling.profile_freq": "20",
    "--profiling.save_memory_snapshot_folder": "snapshots",
    "--optimizer.name": "Adam",
    "--optimizer.eps": "1e-15",
    "--optimizer.lr": "3e-4",
    "--optimizer.min_lr_ratio": "0.2",
    "--training.batch_size": "4",
    "--training.seq_len": "4096",
    "--training.context_len": "1024",
    "--training.warmup_steps": "100",
    "--training.gradient_accumulation_steps": "2",
    "--training.steps": "500",
    "--training.max_norm": "0.5",
    "--training.dataset": "HuggingFaceFW/fineweb-edu",
    "--training.dataset_name": "sample-100BT",
    "--training.dataset_split": "validation",
    "--training.data_dir": "data",
    "--training.data_files": "a.json",
    "--training.data_probs": "1.0",
    "--training.num_workers": "4",
    "--training.prefetch_factor": "4",
    "--training.data_parallel_replicate_degree": "2",
    "--training.data_parallel_shard_degree": "2",
    "--training.tensor_parallel_degree": "2",
    "--training.gc_freq": "10",
    "--training.seed": "79",
    "--metrics.log_freq": "5",
    "--metrics.save_tb_folder": "tb2",
    "--experimental.pipeline_parallel_degree": "2",
    "--experimental.pipeline_parallel_split_points": "layers.2",
    "--experimental.pipeline_parallel_schedule": "Interleaved1F1B",
    "--experimental.pipeline_parallel_schedule_csv": "schedule.csv",
    "--experimental.pipeline_parallel_microbatches": "2",
    "--experimental.context_parallel_degree": "2",
    "--experimental.context_parallel_rotate_method": "alltoall",
    "--checkpoint.folder": "ckpt",
    "--checkpoint.interval": "10",
    "--checkpoint.async_mode": "async",
    "--checkpoint.keep_latest_k": "3",
    "--checkpoint.load_step": "5",
    "--comm.init_timeout_seconds": "600",
    "--comm.train_timeout_seconds": "300",
    "--comm.trace_buf_size": "0",
}
# Options whose only accepted value is what flame does anyway (the other is refused: test below).
SAME_AS_FLAME = {
    "--checkpoint.interval_type": "steps",
    "--float8.scaling_type_input": "dynamic",
    "--float8.scaling_type_weight": "dynamic",
    "--float8.scaling_type_grad_output": "dynamic",
}
# Names that only carry a value to another field: changing them alone changes nothing flame reads.
CARRIERS = set(valid_options(UpstreamJobConfig)) | set(ALIASES)


def flat(config) -> dict:
    out = {}

    def walk(value, prefix):
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{prefix}{f.name}.")
        else:
            out[prefix[:-1]] = value

    walk(config, "")
    return out


BASE = flat(parse_args([]))


def effect(argv: list[str]) -> tuple[set[str], list[str]]:
    """(fields flame reads that argv changes, notices) of a command line over the default job."""
    config = parse_args(argv)
    changed = {k for k, v in flat(config).items() if BASE.get(k) != v}
    return changed - CARRIERS, upstream_notices(config)


def option_forms(option: str, meta: str | None) -> list[list[str]]:
    if meta is None:
        return [[option], [option, "false"]]  # every spelling: test_switches_take_every_spelling
    if option in SAME_AS_FLAME:
        return [[option, SAME_AS_FLAME[option]]]
    if meta.startswith("{"):
        return [[option, choice] for choice in meta[1:-1].split(",")]
    return [[option, VALUES[option]]]


@pytest.mark.parametrize("option, meta", listing(), ids=[name for name, _ in listing()])
def test_every_listed_option_is_accepted_and_acts_or_says_it_does_not(option, meta):
    assert meta is None or meta.startswith("{") or option in VALUES or option in SAME_AS_FLAME
    name = option[2:]
    effects = [effect(argv) for argv in option_forms(option, meta)]
    if name in NO_EFFECT:
        assert any(f"notice: --{name} has no effect in flame: {NO_EFFECT[name]}" in n for _, n in effects)
        assert all(not changed - {name} for changed, _ in effects)  # torchtitan's own field may change
    elif option in SAME_AS_FLAME or meta == "{float32}":  # the one choice the listing offers is the default
        assert all(not changed and not notices for changed, notices in effects)
    else:
        assert any(changed for changed, _ in effects), f"{option} changes nothing flame reads"
        assert all(not notices for _, notices in effects)


@pytest.mark.parametrize(
    "argv, field, value",
    [
        (["--experimental.pipeline_parallel_degree", "2"], "parallelism.pipeline_parallel_degree", 2),
        (["--experimental.context_parallel_degree", "4"], "parallelism.context_parallel_degree", 4),
        (["--experimental.pipeline_parallel_schedule", "GPipe"], "parallelism.pipeline_parallel_schedule", "GPipe"),
        (["--training.batch_size", "8", "--experimental.pipeline_parallel_microbatches", "4"],
         "parallelism.pipeline_parallel_microbatch_size", 2),
        (["--training.disable_loss_parallel"], "parallelism.disable_loss_parallel", True),
        (["--training.fsdp_reshard_after_forward", "never"], "parallelism.fsdp_reshard_after_forward", "never"),
        (["--metrics.rank_0_only", "false"], "metrics.save_for_all_ranks", True),
        (["--metrics.rank_0_only"], "metrics.save_for_all_ranks", False),
        (["--checkpoint.enable_checkpoint", "false"], "checkpoint.enable", False),
        (["--checkpoint.model_weights_only"], "checkpoint.last_save_model_only", True),
        (["--job.print_args"], "job.print_config", True),
        (["--float8.enable_float8_linear"], "model.converters", ["quantize.linear.float8"]),
        (["--float8.recipe_name", "rowwise"], "quantize.linear.float8.recipe_name", "rowwise"),
        (["--float8.enable_fsdp_float8_all_gather"], "quantize.linear.float8.enable_fsdp_float8_all_gather", True),
        (["--optimizer.fused", "false"], "optimizer.implementation", "foreach"),
        (["--training.warmup_steps", "7"], "lr_scheduler.warmup_steps", 7),
    ],
)  # fmt: skip
def test_upstream_names_set_flames_field_of_the_same_meaning(argv, field, value):
    assert flat(parse_args(argv))[field] == value


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint.interval_type", "seconds"], "checkpoint.interval_type seconds is not supported"),
        (["--float8.scaling_type_weight", "delayed"], "float8.scaling_type_weight delayed is not supported"),
        (
            ["--experimental.pipeline_parallel_microbatches", "3"],
            "must divide training.batch_size (8), got 3",
        ),
    ],
)
def test_upstream_values_flame_cannot_honour_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--checkpoint.enable", "false"], False),
        (["--checkpoint.enable", "False"], False),
        (["--checkpoint.enable=false"], False),
        (["--checkpoint.no-enable"], False),
        (["--checkpoint.no_enable"], False),
        (["--no-checkpoint.enable"], False),
        (["--checkpoint.no-enable", "--checkpoint.enable", "true"], True),
        (["--checkpoint.enable_checkpoint", "false"], False),
        (["--no-checkpoint.enable_checkpoint"], False),
        (["--checkpoint.no-enable", "--checkpoint.enable_checkpoint"], True),
    ],
)
def test_switches_take_every_spelling(argv, expected):
    assert parse_args(argv).checkpoint.enable is expected


def test_a_switch_with_a_stray_value_is_one_line():
    with pytest.raises(
        ConfigError, match=r"^--training.compile is a switch: give it alone or with true/false, got 'on'$"
    ):
        parse_args(["--training.compile", "on"])


def test_a_glob_the_shell_expanded_is_one_line_that_says_to_quote_it(tmp_path):
    files = [tmp_path / f"part{i}.jsonl" for i in range(2)]
    for file in files:
        file.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match=rf"^unexpected argument '{files[1]}' after --training.data_files's value: "
                       r"it takes one value; if the shell expanded a glob into several files, quote the glob"):  # fmt: skip
        parse_args(["--training.dataset", "json", "--training.data_files", *map(str, files)])
    with pytest.raises(
        ConfigError, match=r"^unexpected argument 'stray': options are --section.field \[value\]$"
    ):
        parse_args(["--training.dataset", "json", "stray"])


def test_toml_aliases_yield_to_flags_of_their_target(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[training]\ncompile = true\nbatch_size = 4\n[checkpoint]\nenable_checkpoint = false\n")
    config = parse_args(
        ["--job.config_file", str(toml), "--compile.no-enable", "--training.local_batch_size", "2"]
    )
    assert config.compile.enable is False and config.training.local_batch_size == 2
    assert config.checkpoint.enable is False  # the TOML's alias, with no flag against it
    config = parse_args(["--job.config_file", str(toml), "--training.compile", "false"])
    assert config.compile.enable is False


@pytest.mark.parametrize(
    "option, hint",
    [
        ("training.foo", "; run with --help to list every option"),
        ("training.stepz", "; did you mean 'training.steps'?"),
        ("trainng.steps", "; did you mean 'training.steps'?"),
        ("optimizer.warmup_steps", "; did you mean 'lr_scheduler.warmup_steps'?"),
        ("checkpoint.enabled", "; did you mean 'checkpoint.enable'?"),
        ("metrics.rank0_only", "; did you mean 'metrics.rank_0_only'?"),
    ],
)
def test_did_you_mean_only_for_a_near_match(option, hint):
    with pytest.raises(ConfigError) as info:
        parse_args([f"--{option}", "1"])
    assert str(info.value) == f"unknown option --{option}{hint}"


def test_upstream_fla_toml_dataloader_keys_reach_the_dataloader(tmp_path):
    # The [training] keys of upstream flame's flame/models/fla.toml (fla-org/flame e11e7be, 2025-11-16).
    toml = tmp_path / "job.toml"
    toml.write_text("[training]\nnum_workers = 32\npin_memory = false\npersistent_workers = false\n"
                    "prefetch_factor = 2\n")  # fmt: skip
    dataloader = parse_args(["--job.config_file", str(toml)]).training.dataloader
    assert (dataloader.num_workers, dataloader.pin_memory, dataloader.persistent_workers) == (
        32,
        False,
        False,
    )
    assert dataloader.prefetch_factor == 2
    flags = parse_args(
        ["--job.config_file", str(toml), "--training.pin_memory", "--training.persistent_workers"]
    )
    assert (
        flags.training.dataloader.pin_memory is True and flags.training.dataloader.persistent_workers is True
    )


def test_upstream_checkpoint_weights_only_options_set_torchtitans():
    # fla-org/flame e11e7be's config_manager names them so (and negates the first with a no_ spelling).
    config = parse_args(
        ["--checkpoint.no_initial_load_model_weights_only", "--checkpoint.last_save_model_weights_only"]
    )
    assert (
        config.checkpoint.initial_load_model_only is False and config.checkpoint.last_save_model_only is True
    )
    config = parse_args(["--checkpoint.initial_load_model_weights_only"])
    assert (
        config.checkpoint.initial_load_model_only is True and config.checkpoint.last_save_model_only is False
    )


def test_fla_toml_uses_upstream_names_and_keeps_every_checkpoint():
    config = parse_args(["--job.config_file", str(REPO / "flame/models/fla.toml")])
    assert config.checkpoint.enable and config.checkpoint.keep_latest_k == 0
    assert config.optimizer.eps == 1e-15 and config.lr_scheduler.warmup_steps == 1024
    assert config.training.local_batch_size == 8 and config.parallelism.data_parallel_shard_degree == -1
    assert config.model.config == job_config_class()().model.config  # the model is flame's default


def test_docs_table_names_every_listed_option():
    page = (REPO / "docs" / "configs-and-flags.md").read_text()
    table = page[page.index("| upstream option | what flame does |") : page.index("## Optimizer")]
    assert [o for o, _ in listing() if f"`{o}`" not in table and f"`{o} " not in table] == []


def test_train_sh_h_lists_upstream_options():
    result = subprocess.run(["bash", "train.sh", "-h"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    for option in (
        "--experimental.pipeline-parallel-degree",
        "--float8.enable-float8-linear",
        "--job.print-args",
    ):
        assert option in result.stdout, option


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--model.name", "fla"], "model.name"),
        (["--fault_tolerance.enable"], "fault_tolerance.enable"),
    ],
)
def test_options_of_upstreams_later_listing_without_effect_say_so(argv, option):
    notices = upstream_notices(parse_args(argv))
    assert f"notice: --{option} has no effect in flame: {NO_EFFECT[option]}" in notices
