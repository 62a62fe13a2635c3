"""training.skip_nan_inf_limit: the parameters with non-finite gradients are named on the first skipped step, and
the run stops after K consecutive skips without saving another checkpoint."""

import json
from pathlib import Path

import pytest
import torch

from flame.checkpoint.layout import list_steps
from flame.optim.nonfinite import NonFiniteGradients


def test_consecutive_skips_stop_the_run_and_name_the_parameters(make_trainer, tmp_path, caplog):
    dump = tmp_path / "run"
    trainer = make_trainer("--training.skip_nan_inf", "--training.skip_nan_inf_limit", "2", "--training.steps", "6",
                           "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
                           dump=dump)  # fmt: skip
    original = trainer.train_step_fn.forward_backward
    bad = "layers.1.mlp.down_proj.weight"

    def nan_from_step_3(*args):  # step 3 skipped, step 4 fine, then every step non-finite
        result = original(*args)
        if trainer.step == 3 or trainer.step >= 5:
            dict(trainer.model_parts[0].named_parameters())[bad].grad[0, 0] = float("nan")
        return result

    trainer.train_step_fn.forward_backward = nan_from_step_3
    stopped = r"^2 consecutive steps \(to step 6\) had a non-finite gradient"
    with pytest.raises(NonFiniteGradients, match=stopped):
        trainer.train()
    assert trainer.skipped_steps == 3
    named = [r.message for r in caplog.records if "non-finite gradients in" in r.message]
    assert named == [f"step {s}: non-finite gradients in 1 parameter(s): {bad}" for s in (3, 5)]
    # Step 6 stopped the run before its save.
    assert sorted(list_steps(dump / "checkpoint")) == [1, 2, 3, 4, 5]


def optimizer_steps(trainer) -> list[float]:
    return [float(state["step"]) for o in trainer.optimizers for state in o.state.values()]


def steps_with_nan_at(trainer, nan_step: int, name: str, watch):
    """Steps 1..training.steps by hand, a NaN in ``name``'s gradient at ``nan_step``; ``watch(step, changed)`` after
    each, ``changed``: whether any parameter moved."""
    original = trainer.train_step_fn.forward_backward

    def nan_at(*args):
        result = original(*args)
        if trainer.step == nan_step:
            dict(trainer.model_parts[0].named_parameters())[name].grad[0, 0] = float("nan")
        return result

    trainer.train_step_fn.forward_backward = nan_at
    iter(trainer.batches)
    for step in range(1, trainer.last_step + 1):
        before = [p.detach().clone() for p in trainer.model_parts[0].parameters()]
        trainer.step = step
        trainer.train_step(trainer.batches)
        after = trainer.model_parts[0].parameters()
        watch(step, any(not torch.equal(a, b) for a, b in zip(before, after)))


def test_fused_adamw_skips_on_the_device_and_the_verdict_is_read_a_step_later(make_trainer, caplog):
    """Off the log and save steps the host does not read the gradient norm: step 2's verdict stays a device tensor
    until step 3 is queued, while fused AdamW has already left the weights and its state (step count included)
    as they were."""
    trainer = make_trainer("--training.skip_nan_inf", "--metrics.log_freq", "10", "--training.steps", "4")
    assert trainer.train_step_fn.skips_on_device  # the default optimizer: fused AdamW
    bad = "layers.0.attn.q_proj.weight"

    def watch(step, changed):
        assert changed == (step != 2), step
        assert optimizer_steps(trainer) == [step - (step >= 2)] * len(optimizer_steps(trainer))
        said = [r.message for r in caplog.records if "non-finite gradients in" in r.message]
        if step == 2:
            assert isinstance(trainer.nonfinite_steps.pending.skipped, torch.Tensor) and said == []
            assert trainer.skipped_steps == 0
        if step >= 3:
            assert said == [f"step 2: non-finite gradients in 1 parameter(s): {bad}"]
            assert trainer.skipped_steps == 1

    steps_with_nan_at(trainer, 2, bad, watch)
    assert trainer.nonfinite_steps.pending is None  # the last step's verdict is read at once
    assert all(torch.isfinite(p).all() for p in trainer.model_parts[0].parameters())


def test_other_optimizers_skip_on_the_verdict_read_on_the_host(make_trainer, caplog):
    trainer = make_trainer("--training.skip_nan_inf", "--metrics.log_freq", "10", "--training.steps", "3",
                           "--optimizer.implementation", "foreach")  # fmt: skip
    assert not trainer.train_step_fn.skips_on_device
    bad = "layers.1.mlp.up_proj.weight"

    def watch(step, changed):
        assert changed == (step != 2), step
        assert optimizer_steps(trainer) == [step - (step >= 2)] * len(optimizer_steps(trainer))
        if step == 2:
            assert trainer.nonfinite_steps.pending.skipped is True

    steps_with_nan_at(trainer, 2, bad, watch)
    assert trainer.skipped_steps == 1
    assert [r.message for r in caplog.records if "non-finite gradients in" in r.message] == [
        f"step 2: non-finite gradients in 1 parameter(s): {bad}"
    ]


def _fsdp_worker(rank: int, rendezvous: str, out: str) -> None:
    """Two FSDP ranks of the harness's tiny transformer through the trainer's step, a NaN at step 2 in rank 1's
    shard of one gradient only."""
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims

    from flame import compat
    from flame.optim.nonfinite import NonFiniteSteps, named_on_any_rank
    from flame.train.model_parts import Topology, build_model_parts
    from flame.train.step import build_train_step
    from tests.parallelize import harness

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    compat.apply()
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
        dims.build_mesh()
        config = harness.job_config(
            ["--parallelism.data_parallel_shard_degree", "2", "--training.skip_nan_inf"]
        )
        topology = Topology.of(dims, torch.device("cpu"))
        model = build_model_parts(harness.model_args("transformer"), topology, config)
        step = build_train_step(model, topology, config)
        inputs, labels = harness.data_shard(dims)
        verdicts = NonFiniteSteps(enabled=True, limit=0, model_parts=model.parts)
        original = step.forward_backward
        parameters = dict(model.parts[0].named_parameters())
        history = {"on_device": step.skips_on_device, "changed": []}

        def nan_on_rank_1(*args):
            result = original(*args)
            if len(history["changed"]) == 1 and rank == 1:
                parameters[BAD_SHARD].grad.to_local()[0, 0] = float("nan")
            return result

        step.forward_backward = nan_on_rank_1
        for number in (1, 2, 3):
            before = [p.to_local().clone() for p in parameters.values()]
            result = step([({"input": inputs}, labels)])
            verdicts.record(number, result.skipped, result.grad_norm, result.gradient_norms)
            if number == 2:
                history["named"] = named_on_any_rank(verdicts.pending, model.parts)
            history["changed"].append(
                any(not torch.equal(a, p.to_local()) for a, p in zip(before, parameters.values()))
            )
        verdicts.settle()
        history["skipped"] = verdicts.skipped_steps
        Path(out.format(rank=rank)).write_text(json.dumps(history))
    finally:
        dist.destroy_process_group()


BAD_SHARD = "layers.1.mlp.down_proj.weight"


def test_fsdp_ranks_skip_together_on_the_device_and_name_a_shard_of_one_rank(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "rank{rank}.json")
    mp.spawn(_fsdp_worker, args=(str(tmp_path / "rendezvous"), out), nprocs=2, join=True)
    for rank in (0, 1):
        history = json.loads(Path(out.format(rank=rank)).read_text())
        assert history == {
            "on_device": True,
            "changed": [True, False, True],
            "named": [BAD_SHARD],
            "skipped": 1,
        }
