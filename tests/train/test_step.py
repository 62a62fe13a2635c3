"""One training step in-process: token-weighted accumulation, non-finite steps skipped, z-loss, gradient norm
before clipping, hard stop, profiler and debug switches, and the throughput the step lines report."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from flame.loss import IGNORE_INDEX
from tests.trainer_helpers import GivenBatches, tensorboard_scalars

REPO = Path(__file__).resolve().parents[2]


def captured_metrics(trainer) -> list[dict]:
    """Every dict the trainer logs from now on."""
    logged = []
    original = trainer.metrics.log

    def log(step, metrics):
        logged.append(dict(metrics))
        original(step, metrics)

    trainer.metrics.log = log
    return logged


def run_step(trainer, batches, step: int = 1) -> None:
    trainer.step = step
    trainer.train_step(GivenBatches(batches))


def first_rows(trainer, rows: int) -> tuple[dict, torch.Tensor]:
    """The first rows of the training data, with most labels of row 0 masked so micro-batches hold different
    numbers of labelled tokens."""
    iterator = iter(trainer.dataloader)
    inputs, labels = zip(
        *(next(iterator) for _ in range(rows // trainer.job_config.training.local_batch_size))
    )
    inputs, labels = torch.cat([i["input"] for i in inputs]), torch.cat(labels)
    labels[0, :50] = IGNORE_INDEX
    return {"input": inputs}, labels


def test_accumulation_of_two_half_batches_equals_one_batch(make_trainer):
    big = make_trainer("--training.batch_size", "4", "--training.max_norm", "1e9")
    small = make_trainer("--training.batch_size", "2", "--training.gradient_accumulation_steps", "2",
                         "--training.max_norm", "1e9")  # fmt: skip
    assert small.accumulation == 2
    for a, b in zip(big.model_parts[0].parameters(), small.model_parts[0].parameters()):
        assert torch.equal(a, b)  # same seed, same initial weights
    inputs, labels = first_rows(big, 4)
    big_log, small_log = captured_metrics(big), captured_metrics(small)
    run_step(big, [(inputs, labels)])
    run_step(
        small, [({"input": inputs["input"][:2]}, labels[:2]), ({"input": inputs["input"][2:]}, labels[2:])]
    )
    # Token-weighted: the mean over all 4 x 64 - 50 labelled tokens, not the mean of the two micro-batch means.
    assert small_log[0]["loss/train"] == pytest.approx(big_log[0]["loss/train"], rel=1e-6)
    for (name, a), b in zip(big.model_parts[0].named_parameters(), small.model_parts[0].parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_non_finite_gradient_skips_the_step_and_training_goes_on(make_trainer, monkeypatch):
    trainer = make_trainer("--training.skip_nan_inf", "--training.steps", "4")
    original = trainer.train_step_fn.forward_backward

    def nan_at_step_2(*args):
        result = original(*args)
        if trainer.step == 2:
            next(trainer.model_parts[0].parameters()).grad[0, 0] = float("nan")
        return result

    monkeypatch.setattr(trainer.train_step_fn, "forward_backward", nan_at_step_2)
    logged = captured_metrics(trainer)
    iter(trainer.batches)
    for step in range(1, 5):
        before = [p.detach().clone() for p in trainer.model_parts[0].parameters()]
        trainer.step = step
        trainer.train_step(trainer.batches)
        after = list(trainer.model_parts[0].parameters())
        changed = any(not torch.equal(a, b) for a, b in zip(before, after))
        assert changed == (step != 2), step
    assert trainer.skipped_steps == 1
    assert [m["skipped_steps"] for m in logged] == [0, 1, 1, 1]
    assert math.isnan(logged[1]["grad_norm"])
    assert all(math.isfinite(m["loss/train"]) for m in logged)
    assert all(torch.isfinite(p).all() for p in trainer.model_parts[0].parameters())
    assert trainer.state_dict()["skipped_steps"] == 1  # saved with checkpoints


def test_logged_gradient_norm_is_the_norm_before_clipping(make_trainer):
    trainer = make_trainer("--training.max_norm", "0.001")
    logged = captured_metrics(trainer)
    run_step(trainer, [next(iter(trainer.dataloader))])
    grads = [p.grad for p in trainer.model_parts[0].parameters()]
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    assert clipped == pytest.approx(0.001, rel=1e-3)
    assert logged[0]["grad_norm"] > 1.0  # an untrained model's gradient, far above max_norm


def test_z_loss_is_added_to_the_loss_and_logged_apart(make_trainer):
    plain = make_trainer("--training.max_norm", "1e9")
    with_z = make_trainer("--training.max_norm", "1e9", "--training.z_loss", "0.01")
    batch = next(iter(plain.dataloader))
    with torch.no_grad():
        lse = plain.model_parts[0](batch[0]["input"]).logsumexp(-1)  # the initial weights: same in both
    plain_log, z_log = captured_metrics(plain), captured_metrics(with_z)
    run_step(plain, [batch])
    run_step(with_z, [batch])
    assert "loss/z_loss" not in plain_log[0]
    assert z_log[0]["loss/train"] == pytest.approx(plain_log[0]["loss/train"], rel=1e-6)  # cross-entropy only
    assert z_log[0]["loss/z_loss"] == pytest.approx(0.01 * lse.square().mean().item(), rel=1e-4)
    grads = [
        (a.grad, b.grad)
        for a, b in zip(plain.model_parts[0].parameters(), with_z.model_parts[0].parameters())
    ]
    assert any(not torch.allclose(a, b) for a, b in grads)


def test_hard_stop_ends_early_on_the_full_schedule(make_trainer, tmp_path):
    trainer = make_trainer("--training.steps", "10", "--training.stop_at_step", "3", "--checkpoint.enable",
                           "--checkpoint.interval", "100", dump=tmp_path / "run")  # fmt: skip
    trainer.train()
    assert trainer.step == 3
    lrs = tensorboard_scalars(tmp_path / "run", "lr")
    assert sorted(lrs) == [1, 2, 3]
    # Step 3 of a 10-step schedule (1 warmup step, cosine to 0.1, as the default job): not the end of a 3-step one.
    expected = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 1 / 9)))
    assert lrs[3] == pytest.approx(expected, rel=1e-5)
    assert (tmp_path / "run" / "checkpoint" / "step-3").is_dir()  # saved at the stop, to resume from


def test_profiler_writes_traces_on_cpu(make_trainer, tmp_path):
    trainer = make_trainer("--profiling.enable_profiling", "--profiling.profile_freq", "2",
                           "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1",
                           dump=tmp_path / "run")  # fmt: skip
    trainer.train()
    traces = sorted((tmp_path / "run" / "profile_traces").rglob("rank0_trace.json"))
    assert [t.parent.name for t in traces] == ["iteration_2", "iteration_4"]
    assert traces[0].stat().st_size > 1000


def test_memory_snapshot_needs_a_gpu(make_trainer):
    from flame.errors import FlameError

    with pytest.raises(FlameError, match="enable_memory_snapshot records CUDA memory; it needs a GPU"):
        make_trainer("--profiling.enable_memory_snapshot")


def test_the_trainer_refuses_an_fla_class_without_a_gpu(make_trainer, tmp_path):
    """python -m flame.train without train.sh's pre-flight: the same one line, before the model is built."""
    from flame.errors import FlameError

    config = tmp_path / "gla.json"
    config.write_text('{"model_type": "gla", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2}')
    with pytest.raises(
        FlameError, match="model_type 'gla' is FLA's class, whose layers run Triton kernels only"
    ):
        make_trainer("--model.config", str(config))


def test_debug_mode_blocks_cuda_launches_and_detects_anomalies(monkeypatch, tmp_path):
    from flame.launch import preflight
    from flame.train import enable_debug_mode

    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    try:
        enable_debug_mode()
        assert torch.is_anomaly_enabled()
        assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
    finally:
        torch.autograd.set_detect_anomaly(False)
    # train.sh exports it before starting the ranks.
    env_file = tmp_path / "env"
    monkeypatch.setenv("FLAME_LAUNCH_ENV", str(env_file))
    assert preflight(["--debug.enable", "--job.dump_folder", str(tmp_path / "run")]) == 0
    assert "export CUDA_LAUNCH_BLOCKING=1" in env_file.read_text().splitlines()
    assert preflight(["--job.dump_folder", str(tmp_path / "run")]) == 0
    assert "CUDA_LAUNCH_BLOCKING" not in env_file.read_text()


class DeviceValue(torch.Tensor):
    """A step result that must stay on the device: reading it on the host (a sync on a GPU) fails."""

    def _read(self, *args):
        raise AssertionError("a step result was read on the host")

    item = tolist = __float__ = __int__ = __bool__ = __format__ = _read


def test_steps_that_log_nothing_read_no_step_result_on_the_host(make_trainer, monkeypatch):
    trainer = make_trainer("--metrics.log_freq", "3", "--training.steps", "6")
    step_type = type(trainer.train_step_fn)
    step = step_type.__call__

    def results_kept_on_the_device(self, batches):
        result = step(self, batches)
        values = [result.local_share, result.grad_norm, *result.metrics.values()]
        assert all(type(value) is torch.Tensor for value in values)  # tensors, not floats
        result.local_share, result.grad_norm = (v.as_subclass(DeviceValue) for v in values[:2])
        result.metrics = {name: v.as_subclass(DeviceValue) for name, v in result.metrics.items()}
        return result

    monkeypatch.setattr(step_type, "__call__", results_kept_on_the_device)
    monkeypatch.setattr(step_type, "global_metrics", DeviceValue._read)  # a collective that reads the loss
    iter(trainer.batches)
    for trainer.step in (2, 4, 5):  # not log steps (1, every 3rd, the last)
        trainer.train_step(trainer.batches)
    trainer.step = 3  # a log step: its results are read once the next step is queued
    trainer.train_step(trainer.batches)
    trainer.step = 4
    with pytest.raises(AssertionError, match="read on the host"):
        trainer.train_step(trainer.batches)


@pytest.mark.parametrize(("mode", "marks"), [("reduce-overhead", 2), ("max-autotune-no-cudagraphs", 0)])
def test_each_step_marks_a_new_cuda_graph_step_when_the_blocks_replay_graphs(
    make_trainer, monkeypatch, mode, marks
):
    """CUDA graphs reuse a graph's output memory on its next replay: each step tells torch's cudagraph trees that
    the last step's outputs are dead. (torch.compile is a pass-through here: inductor's CUDA graphs need a GPU.)"""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    calls = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append("mark"))
    trainer = make_trainer("--compile.enable", "--compile.mode", mode)
    inputs, labels = first_rows(trainer, trainer.job_config.training.local_batch_size)
    run_step(trainer, [(inputs, labels)], step=1)
    run_step(trainer, [(inputs, labels)], step=2)
    assert calls == ["mark"] * marks


def test_the_trainers_objective_takes_the_l2warp_of_the_model_config_or_the_flag(make_trainer, tmp_path):
    config = json.loads((REPO / "flame" / "assets" / "tiny.json").read_text())
    path = tmp_path / "l2warp.json"
    path.write_text(json.dumps({**config, "use_l2warp": True}))
    trainers = [make_trainer("--model.config", str(path)), make_trainer("--training.enable_l2wrap",
                "--training.l2wrap_factor", "2e-4"), make_trainer()]  # fmt: skip
    assert [t.train_step_fn.objective.l2warp for t in trainers] == [1e-4, 2e-4, 0.0]
    logged = captured_metrics(trainers[0])
    run_step(trainers[0], [next(iter(trainers[0].dataloader))])
    assert math.isfinite(logged[0]["loss/train"])


def test_a_log_step_is_written_once_the_next_step_is_queued(make_trainer):
    """Reading a step's loss back waits for that step: it is read after the next step's kernels are queued, so the
    host never idles the device; the first step (its time is the time to it) and the last are written at once."""
    trainer = make_trainer("--training.steps", "4", "--validation.enable", "--validation.freq", "2",
                           "--validation.steps", "1")  # fmt: skip
    written = []
    log, log_validation = trainer.metrics.log, trainer.metrics.log_validation

    def spy(step, metrics):
        written.append(("train", step, trainer.step))
        log(step, metrics)

    def spy_validation(step, metrics, seconds):
        written.append(("validation", step, trainer.step))
        log_validation(step, metrics, seconds)

    trainer.metrics.log, trainer.metrics.log_validation = spy, spy_validation
    trainer.train()
    # step 2's line is written before its validation's; step 3's during step 4
    assert written == [("train", 1, 1), ("train", 2, 2), ("validation", 2, 2), ("train", 3, 4), ("train", 4, 4),
                       ("validation", 4, 4)]  # fmt: skip


# Each step's work, and the wait for each batch, on the test's clock.
STEP_SECONDS, DATA_SECONDS = 0.3, 0.1
VALIDATION_SECONDS = 0.5


class StepClock:
    """The clock of the trainer, its metrics and its batch prefetcher in this test: it moves only when the test's
    stand-ins for a step's work, a batch's wait and a validation sleep on it, so every time is exact on any host."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class SlowLoader:
    """The trainer's dataloader, each batch DATA_SECONDS late on ``clock``."""

    def __init__(self, loader, clock: StepClock):
        self.loader = loader
        self.clock = clock

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            self.clock.sleep(DATA_SECONDS)
            yield batch


@pytest.mark.parametrize(
    ("flags", "saves", "lines"),
    [
        (["--training.steps", "4"], (), [1, 2, 3, 4]),  # 2 and 3 written during the next step, 4 at once
        (["--training.steps", "5", "--metrics.log_freq", "2"], (), [1, 2, 4, 5]),  # lines of 1 and 2 steps
        (["--training.steps", "4"], (2,), [1, 2, 3, 4]),  # 2 written at once: a checkpoint follows
        # A validation (VALIDATION_SECONDS) after step 3, within line 4's steps: not training time.
        (["--training.steps", "4", "--metrics.log_freq", "2", "--validation.enable", "--validation.freq", "3",
          "--validation.steps", "1"], (), [1, 2, 4]),
    ],
)  # fmt: skip
def test_each_line_measures_the_steps_it_reports(make_trainer, monkeypatch, flags, saves, lines):
    """A line's tokens/s and data-loading share cover the steps since the last line, up to the end of its own
    step, whether the line is written during the next step or at once (the first and last steps, a step that
    saves), and leave validation out: every step takes STEP_SECONDS plus DATA_SECONDS waiting for its batch on the
    test's clock, so every line has the same tokens/s and data-loading share."""
    import flame.data.prefetch
    import flame.metrics
    import flame.train.trainer

    clock = StepClock()
    for module in (flame.metrics, flame.data.prefetch, flame.train.trainer):
        monkeypatch.setattr(module, "time", clock)
    trainer = make_trainer(*flags)
    if trainer.validator is not None:
        validate = trainer.validator.validate

        def slow_validation(*args):
            clock.sleep(VALIDATION_SECONDS)
            return validate(*args)

        monkeypatch.setattr(trainer.validator, "validate", slow_validation)
    step_type = type(trainer.train_step_fn)
    step = step_type.__call__

    def slow_step(self, batches):
        clock.sleep(STEP_SECONDS)  # the step's work: on the CPU it is done when the step returns
        return step(self, batches)

    monkeypatch.setattr(step_type, "__call__", slow_step)
    monkeypatch.setattr(trainer.checkpointer, "due", lambda step, last_step=False: step in saves)
    trainer.batches.loader = SlowLoader(trainer.batches.loader, clock)
    written = {}
    log = trainer.metrics.log

    def spy(step, metrics):
        log(step, metrics)  # adds the throughput to metrics
        written[step] = metrics

    trainer.metrics.log = spy
    trainer.train()
    assert sorted(written) == lines
    tokens_per_step = 2 * 64  # --training.batch_size 2 x --training.seq_len 64
    for line, metrics in written.items():
        assert metrics["throughput/tokens_per_second_per_device"] == pytest.approx(
            tokens_per_step / (STEP_SECONDS + DATA_SECONDS), rel=1e-9
        ), line
        assert metrics["throughput/data_loading_share"] == pytest.approx(
            DATA_SECONDS / (STEP_SECONDS + DATA_SECONDS), rel=1e-9
        ), line


# What the flaky backend's kernels raise at their next calls, in order: in its forward and in its backward.
FLAKY_ERRORS: dict[str, list[Exception]] = {"forward": [], "backward": []}


def build_failure() -> Exception:
    """Triton's error for a kernel config past the GPU's shared memory."""
    from triton.runtime.errors import OutOfResources

    return OutOfResources(232448, 166912, "shared memory")


BUILD_FAILURE_LINE = (
    "failed to build its kernel (OutOfResources: out of resource: shared memory, Required: 232448, Hardware limit: "
    "166912. Reducing block sizes or `num_stages` may help.)"
)


@torch.library.custom_op("flame_test::flaky_attention", mutates_args=(), device_types="cpu")
def flaky_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A kernel's forward as a custom op (a compiled graph calls it directly): the reference's causal softmax."""
    from flame.ops.attention import reference_causal_attention

    if FLAKY_ERRORS["forward"]:
        raise FLAKY_ERRORS["forward"].pop(0)
    return reference_causal_attention(q, k, v, impl="softmax", window_size=None, cu_seqlens=None, scale=None)


@flaky_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


@torch.library.custom_op("flame_test::flaky_attention_bwd", mutates_args=(), device_types="cpu")
def flaky_attention_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flame.ops.attention import reference_causal_attention

    if FLAKY_ERRORS["backward"]:
        raise FLAKY_ERRORS["backward"].pop(0)
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        o = reference_causal_attention(*inputs, impl="softmax", window_size=None, cu_seqlens=None, scale=None)
        return torch.autograd.grad(o, inputs, do)


@flaky_attention_bwd.register_fake
def _(q, k, v, do):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


flaky_attention.register_autograd(
    lambda ctx, do: flaky_attention_bwd(*ctx.saved_tensors, do), setup_context=_save_inputs
)


@pytest.fixture
def flaky_attention_backend(monkeypatch):
    """The attention op with one backend, "auto": the custom ops above, raising FLAKY_ERRORS; where it is out the
    op's PyTorch code serves the call, as it serves CPU calls. ``serve_cpu_calls(True)`` sends CPU calls to the
    backend as a GPU's calls go."""
    from flame.ops import dispatch

    def flaky(q, k, v, *, impl, window_size, cu_seqlens, scale):
        assert impl == "softmax" and window_size is None and cu_seqlens is None and scale is None
        return flaky_attention(q, k, v)

    entry = dispatch._TABLE["attention"]
    # The trainer pins the backend its attention_backend names, "auto" by default.
    monkeypatch.setattr(
        entry, "cuda_backends", {"auto": dispatch.Backend(flaky, code=(f"{__name__}.flaky_attention",))}
    )
    monkeypatch.setattr(entry, "missing", {})
    monkeypatch.setattr(entry, "failed", {})
    monkeypatch.setattr(entry, "pinned", None)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(dispatch, "_PASSED_OVER", set())
    monkeypatch.setitem(FLAKY_ERRORS, "forward", [])
    monkeypatch.setitem(FLAKY_ERRORS, "backward", [])

    def serve_cpu_calls(on: bool) -> None:
        torch._dynamo.reset()  # compiled blocks decided with the other answer
        monkeypatch.setattr(entry, "runs_kernels_for", lambda x: on)

    entry.serve_cpu_calls = serve_cpu_calls
    yield entry
    del entry.serve_cpu_calls
    torch._dynamo.reset()


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("compiled", [True, False])
def test_a_kernel_that_fails_to_build_where_the_table_chose_earlier_is_out_and_the_step_starts_over(
    make_trainer, flaky_attention_backend, caplog, stage, compiled
):
    """A backend whose kernel fails to build inside a compiled block, or in the backward pass, where the dispatch
    table chose it earlier: the backend is out with one log line, and the step starts over on what serves the call next, here
    the PyTorch code (the blocks traced again), giving what a run on it alone gives: the reference trainer's CPU
    calls run that code."""
    flags = ("--compile.enable", "--compile.backend", "aot_eager") if compiled else ()
    trainer, reference = make_trainer(*flags), make_trainer(*flags)
    batches = [first_rows(trainer, 2)]
    flaky_attention_backend.serve_cpu_calls(False)
    expected = reference.train_step_fn(batches)
    flaky_attention_backend.serve_cpu_calls(True)
    FLAKY_ERRORS[stage].append(build_failure())
    with caplog.at_level("WARNING"):
        result = trainer.train_step_fn(batches)
    assert FLAKY_ERRORS[stage] == []  # raised
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")] == [
        f"attention: the auto backend {BUILD_FAILURE_LINE}; the pytorch implementation serves it"
    ]
    assert torch.equal(result.metrics["loss"], expected.metrics["loss"])
    assert torch.equal(result.grad_norm, expected.grad_norm)
    for ours, theirs in zip(trainer.model_parts[0].parameters(), reference.model_parts[0].parameters()):
        assert torch.equal(ours, theirs)


def test_with_several_ranks_a_kernel_that_fails_to_build_ends_the_run_naming_the_backend_to_turn_off(
    make_trainer, flaky_attention_backend, monkeypatch
):
    from flame.errors import KernelBuildError

    trainer = make_trainer("--compile.enable", "--compile.backend", "aot_eager")
    monkeypatch.setattr(trainer.train_step_fn.topology.parallel_dims, "world_size", 2)
    flaky_attention_backend.serve_cpu_calls(True)
    FLAKY_ERRORS["backward"].append(build_failure())
    with pytest.raises(KernelBuildError) as raised:
        trainer.train_step_fn([first_rows(trainer, 2)])
    assert str(raised.value) == (
        f"attention: the auto backend {BUILD_FAILURE_LINE}; 2 ranks cannot start the step over without it: run again "
        "with FLAME_BACKENDS_OFF=attention:auto"
    )


def test_an_error_that_is_not_a_kernel_build_failure_ends_the_step_as_it_is(
    make_trainer, flaky_attention_backend
):
    trainer = make_trainer("--compile.enable", "--compile.backend", "aot_eager")
    flaky_attention_backend.serve_cpu_calls(True)
    FLAKY_ERRORS["backward"].append(ValueError("do has the wrong shape"))
    with pytest.raises(ValueError, match="do has the wrong shape"):
        trainer.train_step_fn([first_rows(trainer, 2)])
    assert flaky_attention_backend.failed == {}
