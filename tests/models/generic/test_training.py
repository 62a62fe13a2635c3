"""Transformers' Llama, Qwen3 and OLMo2 trained by flame: the loss falls, the HF export loads with plain
transformers and computes flame's logits. Qwen3 (tied embeddings) through train.sh on 2 CPU ranks (FSDP per block
over gloo): a run resumed from a checkpoint repeats the uninterrupted one exactly, and its export converts back to the
same DCP tensors. Llama and OLMo2 train in this process (one rank), to keep the suite fast."""

import json
import shutil

import pytest
import torch

from flame.checkpoint.dcp_io import load_model_tensors
from flame.cli import convert_dcp_to_hf, convert_hf_to_dcp
from flame.hf.load import load
from flame.models import build_model, load_model_args
from tests.checkpoint.helpers import output
from tests.models.generic.helpers import train_sh, write_config
from tests.trainer_helpers import GivenBatches, tensorboard_scalars

pytestmark = pytest.mark.slow

JOB = ["--training.steps", "4", "--training.seq_len", "64", "--training.batch_size", "2", "--training.seed", "7",
       "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3", "--checkpoint.interval", "2"]  # fmt: skip


def trained_model(config, step_dir):
    """flame's model with the weights of a DCP checkpoint, built as the trainer builds it (init_weights also
    computes the buffers that checkpoints do not hold, such as rotary frequencies)."""
    args, _ = load_model_args(config)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    state = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    load_model_tensors(step_dir, state)
    model.load_state_dict(state)
    return model.eval()


def check_export(dump, config, name):
    """The HF folder train.sh wrote at the end loads with transformers alone and gives flame's logits."""
    from transformers import AutoModelForCausalLM

    assert json.loads((dump / "config.json").read_text())["model_type"] == name
    exported = AutoModelForCausalLM.from_pretrained(dump).eval()
    assert type(exported).__module__.startswith("transformers.models.")
    flame_model = trained_model(config, dump / "checkpoint" / "step-4")
    tokens = torch.randint(0, 4096, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, flame_model(tokens), rtol=1e-5, atol=1e-5)
        # flame.hf.load (evaluation, generation, diagnostics) reads the same model from the checkpoint.
        assert torch.equal(load(dump, step=4).model(tokens), flame_model(tokens))
    return flame_model


def train(dump, config, *flags, export_hf=True):
    result = train_sh(dump, "--model.config", str(config), *JOB, *flags, export_hf=export_hf)
    assert result.returncode == 0, output(result, dump)
    assert "Applied FSDP to the model" in result.stdout
    return tensorboard_scalars(dump, "loss/train")


@pytest.mark.parametrize("name", ["llama", "olmo2"])
def test_trains_and_exports_for_plain_transformers(tmp_path, make_trainer, name):
    config, dump = write_config(tmp_path, name), tmp_path / "run"
    trainer = make_trainer(
        "--model.config", str(config), "--checkpoint.enable", "--optimizer.lr", "3e-3", dump=dump
    )
    trainer.train()
    losses = tensorboard_scalars(dump, "loss/train")
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], losses
    assert convert_dcp_to_hf.main(["--path", str(dump)]) == 0
    check_export(dump, config, name)


def test_qwen3_resumes_exactly_and_round_trips_through_hf(tmp_path):
    config = write_config(tmp_path, "qwen3")  # tied embeddings
    expected = train(tmp_path / "uninterrupted", config)
    assert sorted(expected) == [1, 2, 3, 4] and expected[4] < expected[1], expected

    # Resumed on 2 ranks from the step-2 checkpoint: steps 3-4 repeat exactly.
    dump = tmp_path / "run"
    shutil.copytree(tmp_path / "uninterrupted" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    assert train(dump, config, export_hf=False) == {3: expected[3], 4: expected[4]}

    flame_model = check_export(tmp_path / "uninterrupted", config, "qwen3")
    step0 = tmp_path / "imported" / "checkpoint" / "step-0"
    assert (
        convert_hf_to_dcp.main(["--model", str(tmp_path / "uninterrupted"), "--checkpoint", str(step0)]) == 0
    )
    imported = trained_model(step0 / "model_config.json", step0)
    for key, value in flame_model.state_dict().items():
        assert torch.equal(imported.state_dict()[key], value), key


def test_activation_checkpointing_and_compile_wrap_each_block(tmp_path, make_trainer):
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    config = write_config(tmp_path, "llama")
    plain = make_trainer("--model.config", str(config), dump=tmp_path / "plain")
    plain.train()
    wrapped = make_trainer("--model.config", str(config), "--activation_checkpoint.mode", "full",
                           "--compile.enable", "--compile.backend", "eager", dump=tmp_path / "wrapped")  # fmt: skip
    blocks = list(wrapped.model_parts[0].model.layers)
    assert len(blocks) == 2
    assert all(isinstance(b, OptimizedModule) and isinstance(b._orig_mod, CheckpointWrapper) for b in blocks)
    wrapped.train()
    expected = tensorboard_scalars(tmp_path / "plain", "loss/train")
    assert sorted(expected) == [1, 2, 3, 4]
    assert tensorboard_scalars(tmp_path / "wrapped", "loss/train") == expected


MIXTRAL = {"model_type": "mixtral", "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4,
           "num_experts_per_tok": 2, "router_aux_loss_coef": 0.05}  # fmt: skip


@pytest.mark.parametrize("router_logits", [True, False])
def test_a_mixture_of_experts_trains_with_its_classes_load_balancing(tmp_path, make_trainer, router_logits):
    """Mixtral with output_router_logits: the step's gradient is that of transformers' own loss, mean cross-entropy
    + router_aux_loss_coef x the router's load balancing (float64, rtol = atol = 1e-10), and the log shows the term;
    without it, the cross-entropy alone, as transformers computes it."""
    import copy
    import math

    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps({**MIXTRAL, "output_router_logits": router_logits}))
    trainer = make_trainer("--model.config", str(path), "--training.max_norm", "1e9")
    model = trainer.model_parts[0].double()
    model.set_experts_implementation("eager")  # the class's grouped_mm kernel takes no float64
    reference = copy.deepcopy(model)
    inputs, labels = next(iter(trainer.dataloader))
    logged = []
    trainer.metrics.log = lambda step, metrics: logged.append(metrics)
    trainer.step = 1
    trainer.train_step(GivenBatches([(inputs, labels)]))
    output = reference.flame_lm_class.forward(reference, input_ids=inputs["input"])  # the class itself
    expected = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten())
    if router_logits:
        expected = expected + reference.router_aux_loss_coef * output.aux_loss
    expected.backward()
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, want.grad, rtol=1e-10, atol=1e-10, msg=name)
    assert ("loss/aux" in logged[0]) == router_logits
    if router_logits:
        assert math.isclose(logged[0]["loss/aux"], 0.05 * output.aux_loss.item(), rel_tol=1e-9)
