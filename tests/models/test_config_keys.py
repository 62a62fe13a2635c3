"""No key of a config is silently dropped by flame's own families: each is a field of the family, irrelevant to the
model flame builds (IRRELEVANT_KEYS, with the reason), an accepted value of a key flame honours only for some
values (RESTRICTED_KEYS), or the dry run refuses it in one line naming the key and what to do."""

import inspect
import json
import warnings

import pytest
import torch

from flame.errors import ModelConfigError
from flame.launch import main
from flame.models import FAMILIES, build_model, get_model_spec, model_args_from_dict
from flame.models.common.args import IRRELEVANT_KEYS, RESTRICTED_KEYS
from tests.utils.helpers import REPO

SHAPES = {
    "transformer": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "vocab_size": 4096},
    "gated_deltanet": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16, "vocab_size": 4096},
    "delta_net": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "vocab_size": 4096},
}  # fmt: skip


def fla_config_class(model_type: str) -> type:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.models
    return {
        c.model_type: c for c in vars(fla.models).values() if isinstance(c, type) and hasattr(c, "model_type")
    }[model_type]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_key_fla_writes_is_read_or_classified(model_type):
    """Every argument of FLA's config class is a field of flame's family, irrelevant or restricted; FLA's own
    config.json (its to_dict, transformers' attributes included) is accepted as it is."""
    import dataclasses

    fla_cls = fla_config_class(model_type)
    fields = {f.name for f in dataclasses.fields(get_model_spec(model_type).args_cls)}
    keys = set(inspect.signature(fla_cls.__init__).parameters) - {"self", "kwargs"}
    assert keys - fields - set(IRRELEVANT_KEYS) - set(RESTRICTED_KEYS) == set()
    written = fla_cls(**SHAPES[model_type]).to_dict()
    args, unknown = model_args_from_dict(written)
    assert not args.generic and unknown == []
    plain, _ = model_args_from_dict({"model_type": model_type, **SHAPES[model_type]})
    assert args == plain  # FLA's defaults are flame's


@pytest.mark.parametrize("model_type", ["gated_deltanet", "delta_net"])  # FLA's transformer needs flash-attn
def test_fla_config_builds_fla_parameter_count(model_type):
    config = {"model_type": model_type, **SHAPES[model_type], "hidden_act": "swish", "fuse_norm": False,
              "pad_token_id": 0, "attn_mode": "chunk", "use_cache": True}  # fmt: skip
    args, _ = model_args_from_dict(config)
    fla_args, _ = model_args_from_dict(config, impl="fla")
    with torch.device("meta"):
        flame_model, fla_model = build_model(args), build_model(fla_args)
    assert sum(p.numel() for p in flame_model.parameters()) == sum(p.numel() for p in fla_model.parameters())


REFUSED = {
    "gelu": ("transformer", {"hidden_act": "gelu"}, 'hidden_act "gelu": flame\'s MLP is SwiGLU', False),
    "powlu": ("gated_deltanet", {"hidden_act": "powlu"}, 'hidden_act "powlu"', True),
    "attnres": ("delta_net", {"attnres_block_size": 4}, "attnres_block_size 4: flame's blocks have no attention residuals", True),
    "l2warp": ("transformer", {"use_l2warp": 1}, "use_l2warp must be true or false, got 1", False),
    "affine": ("transformer", {"elementwise_affine": False}, "elementwise_affine false", False),
    "output-norm": ("delta_net", {"use_output_norm": False}, "use_output_norm false", False),
    "attention-bias": ("transformer", {"attention_bias": True}, "attention_bias true", False),
    "typo": ("gated_deltanet", {"num_head": 4}, "num_head is not a field of flame's gated_deltanet model (did you mean num_heads?)", False),
    # transformers' name: difflib alone would point at num_kv_heads
    "hf-name": ("transformer", {"num_attention_heads": 4}, "num_attention_heads is not a field of flame's transformer model (did you mean num_heads?)", False),
    "nope": ("transformer", {"rope_theta": None}, "rope_theta must be a positive number, got None", False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_dry_run_refuses_a_key_flame_would_drop(tmp_path, capsys, monkeypatch, case):
    model_type, extra, message, points_to_fla = REFUSED[case]
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"model_type": model_type, **SHAPES[model_type], **extra}))
    monkeypatch.setattr("sys.argv", ["flame.launch", "--model.config", str(path), "--job.dry_run"])
    assert main() == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {path}: {message}"), line
    assert ("--model.impl fla" in line) == points_to_fla, line


def test_accepted_values_build_the_model_without_them():
    base = {"model_type": "gated_deltanet", **SHAPES["gated_deltanet"]}
    accepted = {"hidden_act": "silu", "attnres_block_size": None, "use_l2warp": False, "elementwise_affine": True,
                "fuse_norm": False, "fuse_swiglu": False, "fuse_cross_entropy": True,
                "attn_mode": "fused_recurrent", "pad_token_id": 0, "torch_dtype": "bfloat16", "use_cache": False}  # fmt: skip
    assert model_args_from_dict({**base, **accepted})[0] == model_args_from_dict(base)[0]
    with pytest.raises(ModelConfigError, match='hidden_act "relu"'):
        model_args_from_dict({**base, "hidden_act": "relu"})


def test_docs_list_every_irrelevant_and_restricted_key():
    doc = (REPO / "docs" / "models.md").read_text()
    missing = [k for k in [*IRRELEVANT_KEYS, *RESTRICTED_KEYS] if f"`{k}`" not in doc]
    assert missing == []
