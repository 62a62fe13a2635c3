"""Parallelism options are validated before any GPU work, each mistake one line (ConfigError), in train.sh's
pre-flight as well; activation checkpointing wraps flame's blocks; float8 is refused clearly without torchao or
a capable GPU."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from flame.config import parse_args
from flame.errors import ConfigError
from flame.models import build_model, load_model_args
from flame.parallelize import check_parallelism
from flame.parallelize.float8 import check_converters

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def check(world_size: int, *flags: str, config: str = "transformer_340M.json"):
    job_config = parse_args(["--model.config", str(CONFIGS / config), *flags])
    model_args, _ = load_model_args(job_config.model.config)
    return check_parallelism(job_config, model_args, world_size)


def refused(world_size: int, *flags: str, config: str = "transformer_340M.json") -> str:
    with pytest.raises(ConfigError) as error:
        check(world_size, *flags, config=config)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("world_size", "flags", "degrees"),
    [
        (8, [], {"dp_replicate": 1, "dp_shard": 8, "tp": 1}),
        (8, ["--parallelism.data_parallel_replicate_degree", "2"], {"dp_replicate": 2, "dp_shard": 4, "tp": 1}),
        (8, ["--parallelism.tensor_parallel_degree", "4"], {"dp_replicate": 1, "dp_shard": 2, "tp": 4}),
        (4, ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1"],
         {"dp_replicate": 4, "dp_shard": 1, "tp": 1}),
        (8, ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
         {"dp_shard": 2, "cp": 2, "tp": 2}),
        (8, ["--parallelism.context_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.tensor_parallel_degree", "2"], {"dp_shard": 1, "cp": 2, "tp": 2, "pp": 2}),
    ],
)  # fmt: skip
def test_valid_settings_resolve_the_degrees(world_size, flags, degrees):
    resolved = check(world_size, *flags)
    assert {k: resolved[k] for k in degrees} == degrees


def test_degrees_must_multiply_to_the_world_size():
    message = refused(8, "--parallelism.data_parallel_shard_degree", "3")
    assert "is not the world size 8" in message
    message = refused(6, "--parallelism.tensor_parallel_degree", "4")
    assert "does not divide the world size 6" in message
    assert "must be a positive integer" in refused(8, "--parallelism.tensor_parallel_degree", "0")


@pytest.mark.parametrize(
    ("config", "tp", "expected"),
    [
        ("gated_deltanet_340M.json", 4, "does not divide the GatedDeltaNet num_heads (6) of layer 0"),
        ("transformer_7B.json", 16, "does not divide the attention num_kv_heads (8) of layer 0"),
        ("openelm_270m_lws_gqa.json", 2, "does not divide the attention num_kv_heads (3) of layer 0"),
        ("delta_net_340M.json", 16, "does not divide the DeltaNet num_heads (8) of layer 0"),
        ("olmo3_7b_hybrid.json", 4, "does not divide the GatedDeltaNet num_heads (30) of layer 0"),
    ],
)
def test_heads_must_divide_by_the_tensor_parallel_degree(config, tp, expected):
    message = refused(tp, "--parallelism.tensor_parallel_degree", str(tp), config=config)
    assert f"tensor_parallel_degree {tp} {expected}" in message


def test_hybrid_attention_heads_are_checked(tmp_path):
    config = tmp_path / "hybrid.json"
    config.write_text(
        '{"model_type": "gated_deltanet", "hidden_size": 256, "num_hidden_layers": 4, "num_heads": 4,'
        ' "head_dim": 64, "attn": {"layers": [3], "num_heads": 4, "num_kv_heads": 1}}'
    )
    message = refused(2, "--parallelism.tensor_parallel_degree", "2", config=str(config))
    assert "attention num_kv_heads (1) of layer 3" in message


def test_sequence_length_must_split_over_tensor_parallel_ranks():
    message = refused(2, "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "2047")
    assert "training.seq_len 2047 is not divisible by tensor_parallel_degree 2" in message


def test_more_pipeline_stages_than_layers_is_refused():
    # transformer_340M has 24 layers; an interleaved schedule makes 2 stages per rank.
    flags = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    message = refused(16, "--parallelism.pipeline_parallel_degree", "16", *flags)
    assert "32 stages from 24 layers" in message


@pytest.mark.parametrize(
    ("schedule", "batch", "expected"),
    [
        ("1F1B", "1", "pipeline schedule 1F1B needs at least one micro-batch per stage (2), got 1 "),
        (
            "DualPipeV",
            "3",
            "pipeline schedule DualPipeV needs at least one micro-batch per stage (4), got 3 ",
        ),
        ("Interleaved1F1B", "5", "needs a micro-batch count divisible by its rounds (2 = micro-batches // "),
        (
            "InterleavedZeroBubble",
            "7",
            "needs a micro-batch count divisible by its rounds (3 = micro-batches // ",
        ),
    ],
)
def test_micro_batch_counts_a_pipeline_schedule_cannot_run_are_one_line(schedule, batch, expected):
    pp2 = [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
    ]
    message = refused(
        2, *pp2, "--parallelism.pipeline_parallel_schedule", schedule, "--training.batch_size", batch
    )
    assert expected in message
    assert "training.varlen" not in message
    valid = {"1F1B": "2", "DualPipeV": "4", "Interleaved1F1B": "6", "InterleavedZeroBubble": "8"}[schedule]
    check(2, *pp2, "--parallelism.pipeline_parallel_schedule", schedule, "--training.batch_size", valid)


def test_packed_documents_pipeline_only_with_schedules_that_run_one_micro_batch():
    varlen = [
        "--training.varlen",
        "--training.batch_size",
        "1",
        "--parallelism.pipeline_parallel_degree",
        "2",
    ]
    message = refused(2, *varlen, "--parallelism.pipeline_parallel_schedule", "1F1B")
    assert message.endswith(
        "training.varlen makes every batch one packed row: use GPipe, LoopedBFS or Interleaved1F1B"
    )
    for schedule in ("GPipe", "LoopedBFS", "Interleaved1F1B"):
        check(2, *varlen, "--parallelism.pipeline_parallel_schedule", schedule)


def test_unsupported_combinations_are_one_line():
    assert "expert parallelism" in refused(2, "--parallelism.expert_parallel_degree", "2")
    ddp_tp = [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ]
    assert "DDP" in refused(4, *ddp_tp, "--parallelism.tensor_parallel_degree", "2")
    offload = ["--training.enable_cpu_offload", "--parallelism.data_parallel_shard_degree", "1"]
    assert "enable_cpu_offload works through FSDP" in refused(1, *offload)
    units = ["--parallelism.fsdp_blocks_per_unit", "0"]
    assert refused(2, *units) == "parallelism.fsdp_blocks_per_unit must be a positive integer, got 0"
    assert "memory_budget" in refused(1, "--activation_checkpoint.mode", "memory_budget")
    sac = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"]
    assert "selective_ac_option" in refused(1, *sac)
    components = ["--compile.enable", "--compile.components", "model,optimizer"]
    assert refused(1, *components) == "compile.components may hold model and loss, got optimizer"


def test_tied_embeddings_cannot_be_pipelined(tmp_path):
    config = tmp_path / "tied.json"
    config.write_text('{"model_type": "transformer", "hidden_size": 64, "num_hidden_layers": 4, "num_heads": 2,'
                      ' "tie_word_embeddings": true}')  # fmt: skip
    message = refused(2, "--parallelism.pipeline_parallel_degree", "2", config=str(config))
    assert "tie_word_embeddings" in message


def test_float8_is_refused_clearly_without_torchao_or_gpu(monkeypatch):
    job_config = parse_args(["--model.converters", "quantize.linear.float8"])
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match="needs torchao: pip install torchao"):
        check_converters(job_config)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "torchao" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match="needs a GPU of compute capability 8.9"):
        check_converters(job_config, on_gpu=False)
    with pytest.raises(ConfigError, match="is not supported by flame"):
        check_converters(parse_args(["--model.converters", "quantize.linear.mx"]))


def test_float8_on_this_machine_stops_at_parallelize_with_one_line():
    """Through the trainer's entry point: a one-line ConfigError, whatever this machine lacks."""
    from torchtitan.distributed import ParallelDims

    from flame import compat
    from flame.models import build_model
    from flame.parallelize import parallelize_model

    compat.apply()
    job_config = parse_args(["--model.converters", "quantize.linear.float8"])
    model_args, _ = load_model_args(job_config.model.config)
    with torch.device("meta"):
        model = build_model(model_args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine can run float8")
    with pytest.raises(ConfigError, match="quantize.linear.float8 needs"):
        parallelize_model(model, dims, job_config)


@pytest.mark.parametrize(
    ("mode", "option"), [("full", None), ("selective", "op"), ("selective", "1"), ("selective", "2")]
)
def test_activation_checkpointing_wraps_flame_blocks_and_keeps_gradients(mode, option):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from flame.models import build_model
    from flame.parallelize.activation_checkpoint import apply_activation_checkpointing
    from tests.parallelize.harness import batch, initial_state, model_args

    flags = ["--activation_checkpoint.mode", mode]
    if option:
        flags += ["--activation_checkpoint.selective_ac_option", option]
    model = build_model(model_args("hybrid"))
    model.load_state_dict(initial_state("hybrid"))
    reference = build_model(model_args("hybrid"))
    reference.load_state_dict(initial_state("hybrid"))
    apply_activation_checkpointing(model, parse_args(flags))
    wrapped = [isinstance(block, CheckpointWrapper) for block in model.layers.values()]
    assert any(wrapped) and (all(wrapped) or option == "2")
    inputs, labels = batch()
    for m in (model, reference):
        torch.nn.functional.cross_entropy(
            m(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100
        ).backward()
    assert sorted(model.state_dict()) == sorted(reference.state_dict())  # the wrapper keeps parameter names
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_compile_per_block_trains_like_eager():
    from flame.models import build_model
    from flame.parallelize.compile import compile_blocks
    from tests.parallelize.harness import batch, initial_state, model_args

    model = build_model(model_args("gated_deltanet"))
    model.load_state_dict(initial_state("gated_deltanet"))
    eager = build_model(model_args("gated_deltanet"))
    eager.load_state_dict(initial_state("gated_deltanet"))
    compile_blocks(model, backend="eager")  # dynamo tracing through flame's blocks; inductor is the GPU's job
    inputs, labels = batch()
    for m in (model, eager):
        torch.nn.functional.cross_entropy(
            m(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100
        ).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("components", [["model", "loss"], ["model"]])
def test_compiled_loss_gives_the_eager_sums_and_gradients(components):
    """compile.components "loss" compiles flame's loss_sums (cross-entropy and z-loss sums over labelled tokens);
    without it the trainer keeps the eager function."""
    from flame.loss import IGNORE_INDEX, loss_sums
    from flame.parallelize.compile import maybe_compile_loss

    config = parse_args(
        ["--compile.enable", "--compile.backend", "aot_eager", "--compile.components", ",".join(components)]
    )
    loss_fn = maybe_compile_loss(loss_sums, config.compile)
    if "loss" not in components:
        assert loss_fn is loss_sums
        return
    assert loss_fn is not loss_sums
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 37, 101, generator=generator, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 101, (3, 37), generator=generator)
    labels[0, :5] = IGNORE_INDEX
    for z_loss in (False, True):
        results = []
        for fn in (loss_sums, loss_fn):
            cross_entropy, z_term = fn(logits, labels, z_loss=z_loss)
            results.append(
                (cross_entropy, z_term, *torch.autograd.grad(cross_entropy + 1e-2 * z_term, logits))
            )
        torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-12)


def train_sh(*args: str, ngpu: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "train.sh"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NGPU": str(ngpu)},
        cwd=REPO,
    )


def test_preflight_refuses_bad_parallelism_in_one_line():
    result = train_sh("--model.config", str(CONFIGS / "gated_deltanet_340M.json"),
                      "--parallelism.tensor_parallel_degree", "4", ngpu=4)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tensor_parallel_degree 4 does not divide"), lines
    result = train_sh("--parallelism.data_parallel_shard_degree", "3", ngpu=2)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("is not the world size 2 (NGPU x NNODE); use data_parallel_shard_degree -1 for the rest")
    )


def test_context_parallel_settings_it_cannot_run_are_one_line(tmp_path):
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    # Sequence parallelism splits each cp slice again over the tensor-parallel ranks.
    assert (
        "training.seq_len 2050 is not divisible by context_parallel_degree 2 x tensor_parallel_degree 2"
        in refused(4, *cp2, "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "2050")
    )
    pp2 = [*cp2, "--parallelism.pipeline_parallel_degree", "2"]
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        message = refused(4, *pp2, "--parallelism.pipeline_parallel_schedule", schedule)
        assert f"does not combine with the pipeline schedule {schedule}, which splits the backward" in message
    csv = tmp_path / "schedule.csv"
    csv.write_text("0F0,0B0\n")
    message = refused(4, *pp2, "--parallelism.pipeline_parallel_schedule_csv", str(csv))
    assert "does not combine with pipeline_parallel_schedule_csv" in message
    # Packed documents: every family runs on them.
    varlen = [*cp2, "--training.varlen", "--training.batch_size", "1"]
    for config in ("gated_deltanet_340M.json", "delta_net_340M.json", "transformer_340M.json"):
        assert check(2, *varlen, config=config)["cp"] == 2
    assert "training.seq_len 2047 is not divisible by context_parallel_degree 2" in refused(
        2, *cp2, "--training.seq_len", "2047"
    )
    config = tmp_path / "window.json"
    config.write_text(
        '{"model_type": "gated_deltanet", "hidden_size": 256, "num_hidden_layers": 2, "num_heads": 4,'
        ' "head_dim": 64, "attn": {"layers": [1], "num_heads": 4, "window_size": 512}}'
    )
    assert "layers.1.attn: sliding-window softmax attention is not supported with context parallelism" in (
        refused(2, *cp2, config=str(config))
    )
    hybrid = tmp_path / "hybrid.json"
    hybrid.write_text(
        '{"model_type": "gated_deltanet", "hidden_size": 256, "num_hidden_layers": 2, "num_heads": 4,'
        ' "head_dim": 64, "attn": {"layers": [1], "num_heads": 4}}'
    )
    assert check(2, *varlen, config=str(hybrid))["cp"] == 2


def test_fused_linear_cross_entropy_refuses_what_it_cannot_run_in_one_line(tmp_path):
    config = tmp_path / "fused.json"
    config.write_text('{"model_type": "transformer", "hidden_size": 64, "num_hidden_layers": 4, "num_heads": 2,'
                      ' "fuse_linear_cross_entropy": true}')  # fmt: skip
    assert check(4, "--parallelism.context_parallel_degree", "2", config=str(config))["cp"] == 2
    assert refused(2, "--parallelism.tensor_parallel_degree", "2", config=str(config)).startswith(
        "fuse_linear_cross_entropy needs the whole lm_head on each rank"
    )
    assert "pipeline_parallel_degree 1" in refused(2, "--parallelism.pipeline_parallel_degree", "2",
                                                   config=str(config))  # fmt: skip
    assert refused(1, "--job.task", "dpo", config=str(config)).startswith(
        "DPO needs per-sequence log-probabilities"
    )
    float8 = ["--model.converters", "quantize.linear.float8"]
    assert "filter_fqns" in refused(1, *float8, config=str(config))
    assert "filter_fqns" not in refused(1, *float8, "--quantize.linear.float8.filter_fqns", "lm_head",
                                        config=str(config))  # fmt: skip


def test_l2warp_refuses_sharded_logits_and_the_pipelines_loss_in_one_line(tmp_path):
    config = tmp_path / "l2warp.json"
    config.write_text('{"model_type": "transformer", "hidden_size": 64, "num_hidden_layers": 4, "num_heads": 2,'
                      ' "use_l2warp": true}')  # fmt: skip
    assert check(4, "--parallelism.context_parallel_degree", "2", config=str(config))["cp"] == 2
    assert check(1, "--job.task", "dpo", config=str(config))["tp"] == 1  # DPO's loss goes without it
    assert refused(2, "--parallelism.tensor_parallel_degree", "2", config=str(config)).startswith(
        "the L2-warp needs each position's logits over the whole vocabulary"
    )
    assert refused(2, "--parallelism.pipeline_parallel_degree", "2", config=str(config)).startswith(
        "the L2-warp is not applied by the pipeline schedule's loss"
    )
    # upstream flame's flag turns it on for any model
    assert refused(2, "--parallelism.tensor_parallel_degree", "2", "--training.enable_l2wrap").startswith(
        "the L2-warp needs"
    )


def test_compile_mode_reaches_every_compiled_region_and_needs_inductor(monkeypatch):
    """--compile.mode goes to torch.compile for each block and the loss, without CUDA graphs for the loss
    (inductor's modes only: another backend is refused in one line); the default passes no mode."""
    from flame.loss import loss_sums
    from flame.parallelize.compile import compile_blocks, maybe_compile_loss
    from tests.parallelize.harness import model_args

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    config = parse_args(["--compile.enable", "--compile.mode", "reduce-overhead"])
    model = build_model(model_args("gated_deltanet"))
    compile_blocks(model, config.compile.backend, config.compile.mode)
    maybe_compile_loss(loss_sums, config.compile)
    # The blocks replay as CUDA graphs; the loss, whose outputs the step keeps across micro-batches, does not.
    blocks = {"fullgraph": False, "backend": "inductor", "mode": "reduce-overhead"}
    assert calls == [blocks] * len(model.layers) + [{"backend": "inductor"}]
    calls.clear()
    maybe_compile_loss(loss_sums, parse_args(["--compile.enable", "--compile.mode", "max-autotune"]).compile)
    assert calls == [{"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}]
    calls.clear()
    maybe_compile_loss(loss_sums, parse_args(["--compile.enable"]).compile)
    assert calls == [{"backend": "inductor"}]
    message = refused(
        1, "--compile.enable", "--compile.backend", "aot_eager", "--compile.mode", "max-autotune"
    )
    assert message.startswith("compile.mode max-autotune is inductor's; compile.backend is aot_eager")


def test_cuda_graphs_are_refused_under_fsdp_and_kept_with_ddp_and_one_rank():
    graphs = ("--compile.enable", "--compile.mode", "reduce-overhead")
    message = refused(2, *graphs)
    assert message.startswith("compile.mode reduce-overhead replays CUDA graphs, which under FSDP")
    assert (
        "--parallelism.data_parallel_replicate_degree N --parallelism.data_parallel_shard_degree 1" in message
    )
    ddp = (
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    )
    assert check(2, *graphs, *ddp)["dp_replicate"] == 2
    assert check(1, *graphs)["dp_shard"] == 1
    assert check(2, "--compile.enable", "--compile.mode", "max-autotune-no-cudagraphs")["dp_shard"] == 2


def test_cuda_graphs_are_refused_with_packed_documents():
    """A replayed graph would keep the launches of the batch it recorded; the modes without graphs train varlen."""
    varlen = ("--training.varlen", "--training.local_batch_size", "1")
    for mode, without_graphs in (
        ("reduce-overhead", "default"),
        ("max-autotune", "max-autotune-no-cudagraphs"),
    ):
        message = refused(1, "--compile.enable", "--compile.mode", mode, *varlen)
        assert message.startswith(
            f"compile.mode {mode} replays CUDA graphs recorded for one batch, and packed"
        )
        assert message.endswith(f"use --compile.mode {without_graphs} with --training.varlen")
        assert check(1, "--compile.enable", "--compile.mode", without_graphs, *varlen)["dp_shard"] == 1
    assert check(1, "--compile.mode", "reduce-overhead", *varlen)["dp_shard"] == 1  # compile off: no graphs
