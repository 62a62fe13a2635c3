"""training.skip_nan_inf_limit: the parameters with non-finite gradients are named on the first skipped step, and
the run stops after K consecutive skips without saving another checkpoint."""

import pytest

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
