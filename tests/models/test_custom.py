"""Your own model (flame/models/custom.py, examples/custom_models): a package written only against transformers,
imported by --experimental.custom_model_path, --experimental.custom_import or as ``custom_models`` on the path,
dry-runs with its class's parameter count, trains on 2 gloo ranks with FSDP, resumes exactly, exports for plain
transformers (after importing the package) and converts back; a module that does not import is one line."""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.checkpoint.helpers import output
from tests.models.generic.helpers import train_sh
from tests.trainer_helpers import tensorboard_scalars

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
PACKAGE = EXAMPLES / "custom_models"
CONFIG = PACKAGE / "decay_attn.json"
BY_PATH = ["--experimental.custom_model_path", str(PACKAGE)]
BY_IMPORT = ["--experimental.custom_import", "custom_models"]
# custom_import names a module on the path: the example's folder.
ON_PATH = {"PYTHONPATH": f"{EXAMPLES}{os.pathsep}{REPO}"}


@pytest.fixture
def example(monkeypatch):
    """The example package imported in this process (as a user does before loading the export)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import custom_models

    return custom_models


def class_params(example) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(CONFIG.read_text()))
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def dry_run_params(result) -> int:
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("params: ")]
    return int(line.removeprefix("params: "))


def test_dry_run_through_either_flag_and_the_convention(example):
    expected = class_params(example)
    common = ["--model.config", str(CONFIG), "--job.dry_run"]
    launches = [
        lambda: train_sh(None, *BY_PATH, *common),
        lambda: train_sh(None, *BY_IMPORT, *common, env=ON_PATH),
        # Upstream's convention: a package named custom_models in the folder train.sh starts from.
        lambda: train_sh(None, *common, env={"PYTHONPATH": str(REPO)}, cwd=EXAMPLES),
        # Without any of them, transformers does not know the model_type.
        lambda: train_sh(None, *common),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:  # each dry run is one CPU-bound process
        *known, unknown = pool.map(lambda launch: launch(), launches)
    assert [dry_run_params(result) for result in known] == [expected] * 3
    assert unknown.returncode == 2 and "model_type 'decay_attn' is not supported" in unknown.stderr


def test_a_module_that_does_not_import_is_one_line(tmp_path):
    result = train_sh(None, "--experimental.custom_import", "no_such_module")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: cannot import the custom model module no_such_module: ModuleNotFoundError: "
        "No module named 'no_such_module'"
    ]
    broken = tmp_path / "broken_model.py"
    broken.write_text("import torch\nfrom transformers import NoSuchClass\n")
    result = train_sh(None, "--experimental.custom_model_path", str(broken))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot import the custom model module {broken}: ImportError: ")
    assert "NoSuchClass" in line


JOB = ["--model.config", str(CONFIG), "--training.steps", "16", "--training.seq_len", "32",
       "--training.batch_size", "2", "--training.seed", "7", "--lr_scheduler.warmup_steps", "2",
       "--optimizer.lr", "3e-3", "--checkpoint.interval", "8"]  # fmt: skip


@pytest.mark.slow
def test_example_trains_resumes_and_exports(tmp_path, example):
    from transformers import AutoModelForCausalLM

    from flame.cli import convert_hf_to_dcp
    from tests.models.generic.test_training import trained_model

    whole = tmp_path / "whole"
    result = train_sh(whole, *BY_PATH, *JOB)
    assert result.returncode == 0, output(result, whole)
    assert "Applied FSDP to the model" in result.stdout
    expected = tensorboard_scalars(whole, "loss/train")
    assert sorted(expected) == list(range(1, 17)) and expected[16] < expected[1] - 0.5, expected

    # The same job through the other flag, resumed from the step-8 checkpoint: steps 9-16 repeat exactly.
    pieces = tmp_path / "pieces"
    shutil.copytree(whole / "checkpoint" / "step-8", pieces / "checkpoint" / "step-8")
    resumed = train_sh(pieces, *BY_IMPORT, *JOB, env=ON_PATH, export_hf=False)
    assert resumed.returncode == 0, output(resumed, pieces)
    assert "Training starts at step 9" in resumed.stdout
    assert tensorboard_scalars(pieces, "loss/train") == {step: expected[step] for step in range(9, 17)}

    # train.sh's end-of-run export: the user's model_type, loaded by transformers once the package is imported.
    assert json.loads((whole / "config.json").read_text())["model_type"] == "decay_attn"
    exported = AutoModelForCausalLM.from_pretrained(whole).eval()
    assert type(exported) is example.DecayAttnForCausalLM
    flame_model = trained_model(CONFIG, whole / "checkpoint" / "step-16")
    tokens = torch.randint(0, 4096, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, flame_model(tokens), rtol=1e-5, atol=1e-5)

    step0 = tmp_path / "imported" / "checkpoint" / "step-0"
    assert (
        convert_hf_to_dcp.main(
            ["--model", str(whole), "--checkpoint", str(step0), "--custom_model_path", str(PACKAGE)]
        )
        == 0
    )
    imported = trained_model(step0 / "model_config.json", step0)
    for key, value in flame_model.state_dict().items():
        assert torch.equal(imported.state_dict()[key], value), key


def registered(model_type: str, build_body):
    """A causal-LM class registered with transformers under ``model_type``, its body built by ``build_body``."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    config_cls = type(f"{model_type}Config", (PretrainedConfig,), {"model_type": model_type})

    class CausalLM(PreTrainedModel):
        config_class = config_cls

        def __init__(self, config):
            super().__init__(config)
            self.body = build_body(config)
            self.post_init()

        def forward(self, input_ids, **kwargs):
            return CausalLMOutputWithPast(logits=self.body(input_ids))

    AutoConfig.register(model_type, config_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, CausalLM, exist_ok=True)


@pytest.mark.parametrize(
    "model_type, build_body, message",
    [
        ("flame_test_sequential", lambda c: nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)),
         "has no ModuleList of blocks"),
        ("flame_test_two_stacks", lambda c: nn.ModuleDict({"a": nn.ModuleList([nn.Linear(8, 8)] * 2),
                                                            "b": nn.ModuleList([nn.Linear(8, 8)] * 2)}),
         "cannot tell which ModuleList"),
    ],
)  # fmt: skip
def test_a_class_without_declared_blocks_is_one_line(model_type, build_body, message):
    from flame.errors import ModelConfigError
    from flame.models import build_model, model_args_from_dict

    registered(model_type, build_body)
    args, _ = model_args_from_dict({"model_type": model_type, "vocab_size": 16, "num_hidden_layers": 2})
    with torch.device("meta"), pytest.raises(ModelConfigError, match=message) as error:
        build_model(args)
    assert "_no_split_modules = ['YourDecoderLayer']" in str(error.value) and "\n" not in str(error.value)


def test_the_one_stack_of_like_modules_is_the_blocks_when_nothing_declares_them():
    """Blenderbot's causal LM declares no _no_split_modules and its num_hidden_layers counts the encoder's layers:
    the one ModuleList of several modules of one class is taken; two such lists are refused."""
    from flame.models.generic.model import find_blocks

    class Model(nn.Module):
        def __init__(self, lists):
            super().__init__()
            self.config = type("Config", (), {"num_hidden_layers": 2})()
            self.stacks = nn.ModuleDict(
                {f"s{n}": nn.ModuleList([nn.Linear(8, 8) for _ in range(n)]) for n in lists}
            )
            self.head = nn.ModuleList(
                [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)]
            )  # mixed classes: not blocks

    assert find_blocks(Model([3])) == ["stacks.s3"]
    from flame.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match="has no ModuleList of blocks"):
        find_blocks(Model([3, 4]))
