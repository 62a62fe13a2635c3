"""The generic family in one process: transformers' Llama, Qwen3 and OLMo2 built from a config JSON or an HF
folder, with the class's parameter count, its own initialisation, flame's calling convention and its blocks."""

import json
import re

import pytest
import torch
from torch import nn

from flame.errors import ConfigError, ModelConfigError
from flame.models import build_model, load_model_args, model_args_from_dict, model_spec
from flame.models.generic.model import FlameCausalLM
from tests.models.generic.helpers import CONFIGS, dry_run_params, upstream_params, write_config


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dry_run_counts_the_class_parameters(tmp_path, capsys, name):
    path = write_config(tmp_path, name)
    assert dry_run_params(capsys, "--model.config", str(path)) == upstream_params(CONFIGS[name])


def test_an_hf_model_folder_is_a_config(tmp_path, capsys):
    folder = tmp_path / "qwen3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS["qwen3"]))
    assert dry_run_params(capsys, "--model.config", str(folder)) == upstream_params(CONFIGS["qwen3"])


def materialized(path, seed: int) -> nn.Module:
    """Built on the meta device and initialised, as the trainer does."""
    args, _ = load_model_args(path)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_initialisation_is_the_class_own_and_follows_the_seed(tmp_path):
    path = write_config(tmp_path, "qwen3", initializer_range=1.0)
    model = materialized(path, seed=3)
    # transformers' _init_weights: normal(0, initializer_range) for linear layers, ones for the norms.
    assert model.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(1.0, abs=0.05)
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    # tie_word_embeddings: to_empty unties the shared matrix; init_weights ties it again.
    assert model.lm_head.weight is model.get_input_embeddings().weight
    again, other = materialized(path, seed=3), materialized(path, seed=4)
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight)


def test_forward_returns_the_class_logits(tmp_path):
    model = materialized(write_config(tmp_path, "olmo2"), seed=0).eval()
    tokens = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
        expected = super(FlameCausalLM, model).forward(input_ids=tokens).logits  # the class's own
    assert logits.shape == (2, 12, 4096)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    # Restarting positions changes rotary attention: position_ids reach the class.
    with torch.no_grad():
        shifted = model(tokens, position_ids=torch.arange(12).expand(2, -1) + 5)
    assert not torch.allclose(shifted, logits)


def test_blocks_are_the_decoder_layers(tmp_path):
    args, _ = load_model_args(write_config(tmp_path, "llama"))
    with torch.device("meta"):
        model = build_model(args)
    (stack,) = model_spec(args).blocks(model)
    assert stack is model.model.layers and len(stack) == 2


def test_unknown_model_type_is_one_line(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ModelConfigError, match="model_type 'no_such_model' is not supported") as error:
        load_model_args(path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "name, flags, refused",
    [
        # transformers' granite class, whose plan flame has not verified (TENSOR_PARALLEL_MODEL_TYPES take it).
        ("granite", ["--parallelism.tensor_parallel_degree", "2"], "tensor parallelism"),
        ("llama", ["--parallelism.pipeline_parallel_degree", "2"], "pipeline parallelism"),
        ("llama", ["--parallelism.context_parallel_degree", "2"], "context parallelism"),
    ],
)
def test_model_parallelism_is_refused(tmp_path, name, flags, refused):
    from flame.config import parse_args
    from flame.parallelize.checks import check_parallelism

    path = write_config(tmp_path, "llama", model_type=name)
    job = parse_args(["--model.config", str(path), *flags])
    args, _ = load_model_args(path)
    with pytest.raises(ConfigError, match=f"{name} models do not support .*{refused}") as error:
        check_parallelism(job, args, world_size=2)
    assert "\n" not in str(error.value)
    check_parallelism(parse_args(["--model.config", str(path)]), args, world_size=2)  # FSDP: fine


def test_impl_fla_picks_fla_class_over_flame_family(tmp_path, capsys):
    from tests.models.generic.test_fla_families import fla_params

    config = {"model_type": "gated_deltanet", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2,
              "num_heads": 4, "head_dim": 16}  # fmt: skip
    path = tmp_path / "gdn.json"
    path.write_text(json.dumps(config))
    assert not load_model_args(path)[0].generic and not load_model_args(path, "flame")[0].generic
    args, unknown = load_model_args(path, "fla")
    assert args.generic and unknown == []
    with torch.device("meta"):
        model = build_model(args)
    assert type(model).__mro__[2].__module__.startswith("fla.models.gated_deltanet")
    assert dry_run_params(capsys, "--model.config", str(path), "--model.impl", "fla") == fla_params(config)
    # The choice is recorded with the model (checkpoints' flame.json), which rebuilds the same class from it, and
    # not written into the HF export's config.
    recorded = args.to_dict()
    assert recorded["flame_impl"] == "fla"
    from flame.models import model_args_from_dict

    assert model_args_from_dict(recorded)[0].generic
    from flame.models.generic.state_dict_adapter import GenericAdapter

    assert "flame_impl" not in GenericAdapter(args).hf_config()


def test_impl_picks_fla_or_transformers_class_where_both_have_the_model_type(tmp_path, capsys):
    """mamba2: FLA's class under auto and fla, transformers' own under hf (whatever FLA registered over it); the dry
    run's params equal the class's own count, built directly on the meta device."""
    import warnings

    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.models
    config = {"model_type": "mamba2", "vocab_size": 4096, "hidden_size": 48, "num_hidden_layers": 2,
              "num_heads": 6, "head_dim": 16, "n_groups": 2, "expand": 2, "state_size": 8}  # fmt: skip
    path = tmp_path / "mamba2.json"
    path.write_text(json.dumps(config))
    values = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        upstream = {
            "fla": fla.models.Mamba2ForCausalLM(fla.models.Mamba2Config(**values)),
            "hf": transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**values)),
        }
    for impl, cls in (("auto", "fla"), ("fla", "fla"), ("hf", "hf")):
        args, _ = load_model_args(path, impl)
        with torch.device("meta"):
            model = build_model(args)
        assert isinstance(model, type(upstream[cls])), impl
        count = sum(p.numel() for p in upstream[cls].parameters())
        assert dry_run_params(capsys, "--model.config", str(path), "--model.impl", impl) == count


def test_fla_model_types_are_read_without_importing_fla():
    import warnings

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from flame.models.generic.args import fla_model_types, is_fla_class

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.models  # noqa: F401
    registered = {t for t in fla_model_types() if t in CONFIG_MAPPING and is_fla_class(CONFIG_MAPPING[t])}
    assert registered == fla_model_types() and len(registered) >= 40


@pytest.mark.parametrize(
    "config, impl, message",
    [
        ({"model_type": "llama"}, "fla", "--model.impl fla: FLA has no class for model_type 'llama'"),
        ({"model_type": "llama"}, "flame", "--model.impl flame: flame has no implementation of model_type 'llama'"),
        (
            {"model_type": "gated_deltanet"}, "hf",
            "--model.impl hf: transformers has no class for model_type 'gated_deltanet' (FLA has one: --model.impl fla)",
        ),
        ({"model_type": "llama", "flame_impl": "mine"}, "auto", "flame_impl must be one of auto, flame, fla, hf, got 'mine'"),
        (
            {"model_type": "gated_deltanet", "flame_impl": "fla"}, "flame",
            "--model.impl flame contradicts the config's flame_impl fla",
        ),
    ],
)  # fmt: skip
def test_impossible_impl_is_one_line_at_preflight(tmp_path, capsys, monkeypatch, config, impl, message):
    from flame.launch import main

    path = tmp_path / "x.json"
    path.write_text(json.dumps({"vocab_size": 4096, **config}))
    with pytest.raises(ModelConfigError, match=re.escape(message)):
        load_model_args(path, impl)
    monkeypatch.setattr(
        "sys.argv", ["flame.launch", "--model.config", str(path), "--model.impl", impl, "--job.dry_run"]
    )
    assert main() == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and message in line


def test_fla_classes_need_a_gpu_and_everything_else_trains_on_the_cpu(tmp_path):
    """FLA's classes run Triton kernels in every layer (no CPU path: the first forward on a machine without a GPU
    ends in Triton's "0 active drivers"), so a run without CUDA refuses them in one line; flame's families and
    transformers' classes pass."""
    from flame.models import check_device

    gla = tmp_path / "gla.json"
    gla.write_text(
        json.dumps({"model_type": "gla", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2})
    )
    gdn = tmp_path / "gdn.json"
    gdn.write_text(json.dumps({"model_type": "gated_deltanet", "vocab_size": 4096, "hidden_size": 64,
                               "num_hidden_layers": 2, "num_heads": 2, "head_dim": 32}))  # fmt: skip
    for path, impl in [(gla, "auto"), (gdn, "fla")]:
        args, _ = load_model_args(path, impl)
        with pytest.raises(ModelConfigError) as error:
            check_device(args, "cpu")
        model_type = json.loads(path.read_text())["model_type"]
        assert str(error.value).startswith(
            f"model_type '{model_type}' is FLA's class, whose layers run Triton kernels only: it needs a CUDA GPU "
            "and this run has none; on a CPU flame trains its own families"
        )
        check_device(args, "cuda")
    for path, impl in [(gdn, "auto"), (write_config(tmp_path, "llama"), "auto")]:
        check_device(load_model_args(path, impl)[0], "cpu")


def test_a_config_the_class_cannot_build_from_is_one_line_naming_where():
    """transformers' Nemotron divides by num_key_value_heads, which its config leaves null by default."""
    config = {"model_type": "nemotron", "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": None}  # fmt: skip
    args, _ = model_args_from_dict(config)
    with pytest.raises(ModelConfigError) as refused, torch.device("meta"):
        build_model(args)
    message = str(refused.value)
    assert message.startswith("NemotronForCausalLM cannot be built from this config: TypeError: ")
    assert "(transformers/models/nemotron/modeling_nemotron.py:" in message
    assert message.endswith("a key the class needs is missing or null there, so set it in the config")
