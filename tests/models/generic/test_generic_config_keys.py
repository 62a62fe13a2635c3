"""No key of a generic-path config is silently dropped (flame/models/generic/config_keys.py): upstream flame's
FLA configs dry-run with the values FLA uses, hub configs of transformers' models keep their RoPE keys, and every
other key the class would ignore stops the dry run in one line naming the key, the class and what to do."""

import json
import warnings

import pytest
import torch

from flame.errors import ModelConfigError
from flame.launch import EXIT_DONE, main
from flame.models import FAMILIES, model_args_from_dict
from flame.models.generic.args import config_class, transformers_config_class
from flame.models.generic.config_keys import (
    FLA_ATTRIBUTE_KEYS,
    FLA_NESTED_KEYS,
    FLA_RENAMED_KEYS,
    FLA_SETTLED_KEYS,
    FLA_UNREAD_ATTN_KEYS,
    TRANSFORMERS_SETTLED_KEYS,
    accepted_keys,
)
from tests.models.generic.helpers import dry_run_params
from tests.models.generic.test_fla_families import OVERRIDES, TINY, fla_model_types, fla_params
from tests.utils.helpers import REPO

SMALL = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "num_hidden_layers": 2,
}  # flame's default tokenizer: 4096 tokens
# The keys of upstream flame's configs/ (fla-org/flame) that FLA 0.6.0's classes do not take, with upstream's
# values, on a small shape; each maps to the FLA 0.6.0 config that builds the same model.
UPSTREAM = {
    "gsa_340M": (
        {"model_type": "gsa", **SMALL, "num_heads": 4, "num_slots": 16, "expand_k": 0.5, "expand_v": 1,
         "share_conv_kernel": True, "use_rope": False, "use_short_conv": False, "elementwise_affine": False},
        {"exapnd_k": 0.5, "exapnd_v": 1},
    ),
    "mamba_340M": (
        {"model_type": "mamba", **SMALL, "time_step_rank": 8, "time_step_scale": 0.5, "time_step_min": 0.002,
         "time_step_max": 0.2, "time_step_init_scheme": "constant", "time_step_floor": 0.0002},
        {"dt_rank": 8, "dt_scale": 0.5, "dt_min": 0.002, "dt_max": 0.2, "dt_init_scheme": "constant",
         "dt_init_floor": 0.0002},
    ),
    "mamba2_340M": (
        {"model_type": "mamba2", **SMALL, "head_dim": 16, "rms_norm": True, "time_step_rank": 128,
         "time_step_min": 0.002, "time_step_max": 0.2, "time_step_floor": 0.0002},
        {"dt_min": 0.002, "dt_max": 0.2, "dt_init_floor": 0.0002},
    ),
}  # fmt: skip
UPSTREAM_DROPPED = {
    "gsa_340M": ["expand_k", "expand_v", "share_conv_kernel", "use_rope"],
    "mamba_340M": ["time_step_rank", "time_step_scale", "time_step_min", "time_step_max", "time_step_init_scheme",
                   "time_step_floor"],
    "mamba2_340M": ["rms_norm", "time_step_rank", "time_step_min", "time_step_max", "time_step_floor"],
}  # fmt: skip


def fla_config(model_type: str, **values):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.models  # noqa: F401
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **values)


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_configs_dry_run_with_the_values_fla_uses(tmp_path, capsys, name):
    config, fla_names = UPSTREAM[name]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    expected = {k: v for k, v in config.items() if k not in UPSTREAM_DROPPED[name]} | fla_names
    assert dry_run_params(capsys, "--model.config", str(path), "--model.impl", "fla") == fla_params(expected)
    args, _ = model_args_from_dict(config, impl="fla")
    built, reference = args.hf_config(), fla_config(**expected)
    for key in fla_names:  # stored where FLA's model reads them (GSA's exapnd_k as expand_k)
        attribute = key.replace("exapnd", "expand")
        assert (
            getattr(built, attribute)
            == getattr(reference, attribute)
            == config.get(attribute, fla_names[key])
        )


def test_renamed_keys_are_noticed_and_recorded_under_fla_names():
    config, _ = UPSTREAM["mamba_340M"]
    args, notices = model_args_from_dict(config)
    assert sorted(notices) == sorted(
        f"{old} is read as {old.replace('time_step_floor', 'dt_init_floor').replace('time_step', 'dt')} "
        "(FLA's MambaConfig's name for it since FLA 0.5.0, PR 782)"
        for old in UPSTREAM_DROPPED["mamba_340M"]
    )
    # The recorded config holds FLA 0.6.0's names: read again (a checkpoint's flame.json, the HF export), it
    # gives the same args with nothing to notice.
    again, renotices = model_args_from_dict(args.to_dict())
    assert again == args and renotices == []
    exported, renotices = model_args_from_dict(args.hf_config().to_dict())
    assert renotices == [] and exported.hf_config().dt_rank == 8


@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_configs_transformers_saves_read_as_fla_classes_with_their_values(tmp_path, model_type):
    """A config transformers 5 saved for its own Mamba or Mamba2 (layer_norm_epsilon, time_step_*, Mamba2's
    time_step_limit with its infinity tagged) builds FLA's class (auto, as upstream flame after ``import fla``)
    with the same values under FLA's names; --model.impl hf builds transformers' own class from the same file."""
    from flame.models import load_model_args
    from flame.models.generic.args import transformers_config_class

    shape = {"head_dim": 16, "num_heads": 8, "n_groups": 1} if model_type == "mamba2" else {}
    own = transformers_config_class(model_type)(**SMALL, state_size=8, layer_norm_epsilon=1e-6, time_step_min=0.002,
                                                use_cache=False, **shape)  # fmt: skip
    own.save_pretrained(tmp_path)
    if model_type == "mamba2":
        assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    args, notices = load_model_args(tmp_path)
    fla = args.hf_config()
    assert type(fla).__module__.startswith("fla.") and fla.norm_eps == 1e-6 and fla.dt_min == 0.002
    assert f"layer_norm_epsilon is read as norm_eps (FLA's {type(fla).__name__}'s name for it since FLA 0.2.2, PRs 375 and 376)" in notices  # fmt: skip
    if model_type == "mamba2":
        assert list(fla.dt_limit) == [0.0, float("inf")]
    hf, renotices = load_model_args(tmp_path, impl="hf")
    assert renotices == [] and type(hf.hf_config()) is type(own) and hf.hf_config().layer_norm_epsilon == 1e-6


def test_gated_deltaproduct_use_gate_is_read_as_use_output_gate():
    config = {"model_type": "gated_deltaproduct", **SMALL, "num_heads": 2, "head_dim": 16, "use_gate": False}
    args, notices = model_args_from_dict(config)
    assert args.hf_config().use_output_gate is False
    assert notices == [
        "use_gate is read as use_output_gate (FLA's GatedDeltaProductConfig's name for it since FLA 0.3.0, PR 513)"
    ]
    with torch.device("meta"):
        from flame.models import build_model

        gated = model_args_from_dict({**config, "use_gate": True})[0]
        assert sum(p.numel() for p in build_model(args).parameters()) < sum(
            p.numel() for p in build_model(gated).parameters()
        )  # the output gate's projection


def test_preflight_prints_each_rename_as_a_notice(tmp_path, capsys, monkeypatch):
    path = tmp_path / "mamba2.json"
    path.write_text(json.dumps({"model_type": "mamba2", **SMALL, "head_dim": 16, "time_step_min": 0.002}))
    monkeypatch.setattr("sys.argv", ["flame.launch", "--model.config", str(path), "--job.dry_run"])
    assert main() == EXIT_DONE
    (notice,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert notice == f"notice: {path}: time_step_min is read as dt_min (FLA's Mamba2Config's name for it since FLA 0.5.0, PR 782)"  # fmt: skip


def test_upstream_fla_transformer_config_takes_attention_bias_false():
    # transformer_7B's key under --model.impl fla; building FLA's transformer needs flash-attn, so its args are
    # checked, not dry-run.
    config = {
        "model_type": "transformer",
        **SMALL,
        "num_heads": 4,
        "num_kv_heads": 2,
        "attention_bias": False,
    }
    args, notices = model_args_from_dict(config, impl="fla")
    assert args.generic and notices == []


def test_samba_intermediate_size_is_accepted_as_fla_derives_it():
    # samba_1B's keys; building Samba needs flash-attn, so its args are checked, not dry-run.
    attn = {"layers": [1], "num_heads": 4, "num_kv_heads": 4, "qkv_bias": False, "rope_theta": 10000.0,
            "window_size": 2048}  # fmt: skip
    config = {"model_type": "samba", **SMALL, "expand": 2, "intermediate_size": 128, "attn": attn}
    args, notices = model_args_from_dict(config)
    assert notices == [] and args.hf_config().intermediate_size == 128
    with pytest.raises(ModelConfigError, match="intermediate_size 100: FLA's SambaConfig derives 128 "):
        model_args_from_dict({**config, "intermediate_size": 100})


def test_fla_config_files_are_accepted_as_fla_writes_them():
    """FLA's own config.json (its to_dict, derived attributes and transformers' bookkeeping included) of every
    family flame builds through the generic path reads back with nothing to refuse or notice."""
    for model_type in fla_model_types():
        if model_type in FAMILIES:
            continue
        written = fla_config(model_type, **TINY, **OVERRIDES.get(model_type, {})).to_dict()
        args, notices = model_args_from_dict(written)
        assert args.generic and notices == [], model_type


# Hub config.json files of transformers' models as published (shapes shrunk): rope_theta, rope_scaling and
# partial_rotary_factor are consumed by transformers' RoPE standardisation, not by the constructors.
HUB = {
    "llama": {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 8, "hidden_act": "silu",
              "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
              "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
              "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
              "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
              "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
              "use_cache": True, "vocab_size": 4096},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
              "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 40960,
              "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 4096},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
              "intermediate_size": 64, "max_position_embeddings": 4096, "model_type": "olmo2",
              "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4, "pad_token_id": 4095,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False,
              "torch_dtype": "float32", "transformers_version": "4.48.0", "use_cache": True, "vocab_size": 4096},
    "mistral": {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
                "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
                "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 4,
                "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5, "sliding_window": 4096, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True,
                "vocab_size": 4096, "max_length": 4096, "temperature": 0.6},  # sampling settings: generation's
}  # fmt: skip


@pytest.mark.parametrize("name", list(HUB))
def test_hub_configs_keep_their_rope_keys(name):
    config = HUB[name]
    args, notices = model_args_from_dict(config)
    assert args.generic and notices == []
    rope = args.hf_config().rope_parameters
    assert rope["rope_theta"] == config["rope_theta"]
    assert rope.get("partial_rotary_factor") == config.get("partial_rotary_factor")
    assert rope["rope_type"] == (config.get("rope_scaling") or {}).get("rope_type", "default")


# google/gemma-3-1b-pt's config.json as published (shapes shrunk): keys transformers 5 reads in Gemma3TextConfig's
# __post_init__ (sliding_window_pattern) and RoPE conversion (rope_local_base_freq), and a generation setting.
GEMMA3_HUB = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 2, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 4096,
}  # fmt: skip


# Hub config.json files as published (shapes shrunk), with the keys their publishers wrote that transformers' class
# does not take: each trains the model transformers builds from the file.
PUBLISHED = {
    "Qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                      "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 32,
                      "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
                      "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                      "model_type": "qwen3_moe", "moe_intermediate_size": 32, "norm_topk_prob": True,
                      "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                      "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
                      "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                      "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                      "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
                      "vocab_size": 4096},
    "gemma-2-2b": {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                   "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
                   "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 16,
                   "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64,
                   "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 8192,
                   "model_type": "gemma2", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
                   "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
                   "sliding_window": 4096, "torch_dtype": "float32", "transformers_version": "4.42.4",
                   "use_cache": True, "vocab_size": 4096},
    "Phi-3-mini-4k-instruct": {"_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
                               "attention_bias": False, "attention_dropout": 0.0, "auto_map": {
                                   "AutoConfig": "configuration_phi3.Phi3Config",
                                   "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
                               "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
                               "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
                               "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 4,
                               "num_hidden_layers": 2, "num_key_value_heads": 4,
                               "original_max_position_embeddings": 4096, "pad_token_id": 0, "resid_pdrop": 0.0,
                               "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
                               "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                               "transformers_version": "4.40.2", "use_cache": True, "vocab_size": 4096},
    "SmolLM2-135M": {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                     "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 64,
                     "initializer_range": 0.041666666666666664, "intermediate_size": 128, "is_llama_config": True,
                     "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 4,
                     "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                     "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
                     "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
                     "use_cache": True, "vocab_size": 4096},
    "falcon-7b": {"alibi": False, "apply_residual_connection_post_layernorm": False,
                  "architectures": ["FalconForCausalLM"], "attention_dropout": 0.0,
                  "auto_map": {"AutoConfig": "configuration_falcon.FalconConfig"}, "bias": False, "bos_token_id": 11,
                  "eos_token_id": 11, "hidden_dropout": 0.0, "hidden_size": 64, "initializer_range": 0.02,
                  "layer_norm_epsilon": 1e-05, "model_type": "falcon", "multi_query": True,
                  "new_decoder_architecture": False, "num_attention_heads": 4, "num_hidden_layers": 2,
                  "parallel_attn": True, "torch_dtype": "bfloat16", "transformers_version": "4.27.4", "use_cache": True,
                  "vocab_size": 4096},
    "gpt2": {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
             "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
             "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 64, "n_head": 4, "n_layer": 2,
             "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
             "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
             "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 4096},
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_hub_configs_build_what_transformers_builds(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    from flame.models import build_model

    config = PUBLISHED[name]
    args, notices = model_args_from_dict(config)
    assert notices == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own = AutoConfig.for_model(**config)
        with torch.device("meta"):
            shapes = {n: p.shape for n, p in build_model(args).named_parameters()}
            expected = {n: p.shape for n, p in AutoModelForCausalLM.from_config(own).named_parameters()}
    assert shapes == expected
    if name == "Qwen3-30B-A3B":  # head_dim, read by the model (getattr(config, "head_dim", ...)), not 64 / 4
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 32, 64)


TRANSFORMERS_REFUSED = {
    "deepseek-aux-loss": ({"model_type": "deepseek_v3", **SMALL, "num_attention_heads": 4, "aux_loss_alpha": 0.001,
                           "seq_aux": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1},
                          "aux_loss_alpha 0.001: transformers' DeepseekV3Config does not take it (transformers' "
                          "DeepseekV3 trains without an auxiliary balance loss); remove it or set it to 0"),
    "gemma2-two-activations": ({"model_type": "gemma2", **SMALL, "hidden_act": "silu",
                                "hidden_activation": "gelu_pytorch_tanh"},
                               'hidden_act "silu" and hidden_activation "gelu_pytorch_tanh" disagree: transformers\' '
                               "Gemma2Config does not take hidden_act (Gemma 2 reads hidden_activation); remove "
                               'hidden_act or set hidden_activation to "silu"'),
    "qwen3-moe-windows": ({"model_type": "qwen3_moe", **SMALL, "use_sliding_window": True, "max_window_layers": 1},
                          "max_window_layers 1: transformers' Qwen3MoeConfig does not take it (transformers' "
                          "Qwen3-MoE applies sliding_window to every layer); remove it, or set use_sliding_window "
                          "to false"),
    "unread": ({"model_type": "qwen3_moe", **SMALL, "head_dims": 32},
               "head_dims is not a key of transformers' Qwen3MoeConfig"),
    "padding": ({"model_type": "olmo2", **SMALL, "pad_token_id": 100277},
                "pad_token_id 100277 is outside the vocabulary of 4096 tokens; set it below vocab_size or to null"),
    "remote-code": ({"model_type": "my_model", **SMALL, "auto_map": {
                        "AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyForCausalLM"}},
                    "model_type 'my_model' is not supported: flame has no family of that name and transformers has no "
                    "class registered for it (import the package that registers it with "
                    "--experimental.custom_model_path or --experimental.custom_import); its auto_map names remote code "
                    "(configuration_my.MyConfig, modeling_my.MyForCausalLM), which flame does not import on its own: "
                    "register those classes (AutoConfig.register, AutoModelForCausalLM.register) in a module passed "
                    "with --experimental.custom_model_path"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TRANSFORMERS_REFUSED))
def test_keys_transformers_classes_do_not_take_are_refused_with_their_reason(case):
    config, message = TRANSFORMERS_REFUSED[case]
    with pytest.raises(ModelConfigError) as refused:
        model_args_from_dict(config)
    assert str(refused.value).startswith(message), str(refused.value)


def test_keys_a_transformers_class_reads_from_its_kwargs_are_read():
    args, notices = model_args_from_dict(GEMMA3_HUB)
    built = args.hf_config()
    assert notices == [] and built.layer_types == ["sliding_attention", "full_attention"] * 2
    assert built.rope_parameters["sliding_attention"]["rope_theta"] == 10000
    assert built.rope_parameters["full_attention"]["rope_theta"] == 1000000
    # Saved by transformers (its private _sliding_window_pattern included), the config reads back the same.
    again, notices = model_args_from_dict(built.to_dict())
    assert notices == [] and again.hf_config().layer_types == built.layer_types


def test_a_key_only_the_shared_bases_read_is_refused_for_other_classes():
    """transformers' RoPE mixin, which every config class has, reads rope_local_base_freq only for Gemma 3's class."""
    with pytest.raises(
        ModelConfigError, match="rope_local_base_freq is not a key of transformers' LlamaConfig"
    ):
        model_args_from_dict({**HUB["llama"], "rope_local_base_freq": 10000})


# Causal LMs whose config, as transformers saves it with its defaults, flame does not read back, and why.
NOT_READ_BACK = {
    "bailing_hybrid": "transformers' own class builds another linear_head_dim from the file than it saved",
    "gemma4_assistant": "transformers cannot build its default config",
    "gpt-sw3": "transformers cannot build its default config",
}


def test_configs_transformers_saves_for_its_causal_lms_read_back_or_name_their_language_model(tmp_path):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from flame.models import load_model_args
    from flame.models.generic.args import transformers_config_class

    read, composite = [], []
    for model_type in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(NOT_READ_BACK)):
        folder = tmp_path / model_type
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers_config_class(model_type)().save_pretrained(folder)
            try:
                args, _ = load_model_args(folder, impl="hf")
            except ModelConfigError as e:
                assert "is a composite (multimodal) config whose language model is its" in str(e), str(e)
                composite.append(model_type)
                continue
        assert args.model_type == model_type
        read.append(model_type)
    assert {"llama", "qwen3", "gemma3_text", "mamba2", "gpt2"} <= set(read) and len(read) > 150
    assert {"gemma3", "llama4", "qwen3_5"} <= set(composite)


def test_a_hub_config_dry_runs_with_the_class_parameter_count(tmp_path, capsys):
    from tests.models.generic.helpers import upstream_params

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HUB["llama"]))
    assert dry_run_params(capsys, "--model.config", str(folder)) == upstream_params(HUB["llama"])


SAMBA_ATTN = {"layers": [1], "num_heads": 4}
REFUSED = {
    "typo": ({"model_type": "llama", **SMALL, "num_attention_heads": 4, "num_attention_head": 4},
             "num_attention_head is not a key of transformers' LlamaConfig (did you mean num_attention_heads?): "
             "the class would ignore it; remove it or correct its name"),
    "foreign": ({"model_type": "llama", **SMALL, "num_attention_heads": 4, "attnres_block_size": 4},
                "attnres_block_size is not a key of transformers' LlamaConfig"),
    "rope-without-rope": ({"model_type": "gla", **SMALL, "rope_theta": 10000.0},
                          "rope_theta is not a key of FLA's GLAConfig"),
    "use_rope": ({"model_type": "gsa", **SMALL, "use_rope": True},
                 'use_rope true: FLA\'s GSAConfig does not take it (FLA\'s GSA has no rotary embedding'),
    "share_conv_kernel": ({"model_type": "gsa", **SMALL, "use_short_conv": True, "share_conv_kernel": True},
                          "share_conv_kernel true: FLA's GSAConfig does not take it"),
    "rms_norm": ({"model_type": "mamba2", **SMALL, "rms_norm": False},
                 "rms_norm false: FLA's Mamba2Config does not take it (FLA before 0.5.0 applied Mamba2's gated "
                 "RMSNorm whatever rms_norm said; FLA 0.6.0's rmsnorm (default true) is the switch); remove it or "
                 "set it to true"),
    "attention_bias": ({"model_type": "gla", **SMALL, "attention_bias": True},
                       "attention_bias true: FLA's GLAConfig does not take it"),
    "renamed-twice": ({"model_type": "mamba", **SMALL, "time_step_rank": 8, "dt_rank": 4},
                      "time_step_rank 8 and dt_rank 4 disagree: time_step_rank is FLA's MambaConfig's dt_rank under "
                      "its name before FLA 0.5.0, PR 782; remove time_step_rank"),
    "alias-twice": ({"model_type": "gsa", **SMALL, "expand_k": 0.5, "exapnd_k": 1},
                    "expand_k 0.5 and exapnd_k 1 disagree: FLA's GSAConfig stores exapnd_k as expand_k"),
    "derived": ({"model_type": "mamba2", **SMALL, "num_heads": 3},
                "num_heads 3: FLA's Mamba2Config derives 2 from the config's other keys and does not take num_heads;"
                " remove it or set it to 2"),
    "nested": ({"model_type": "gla", **SMALL, "attn": {**SAMBA_ATTN, "num_head": 4}},
               "attn.num_head is not a key of FLA's GLAConfig's attn spec (did you mean num_heads?)"),
    "nested-list": ({"model_type": "gla", **SMALL, "attn": [SAMBA_ATTN, {"layers": [0], "num_heads": 4,
                     "sliding_window": 64}]}, "attn.sliding_window is not a key of FLA's GLAConfig's attn spec"),
    "nested-other": ({"model_type": "rodimus", **SMALL, "block_type": "rodimus_plus",
                      "ska_attn": {"num_heads": 4, "qk_norms": True}},
                     "ska_attn.qk_norms is not a key of FLA's RodimusConfig's ska_attn spec (did you mean qk_norm?)"),
    "nested-unread": ({"model_type": "lightnet", **SMALL, "attn": {**SAMBA_ATTN, "rope_theta": 500000.0}},
                      "attn.rope_theta 500000.0: FLA's LightNetConfig's blocks build their attention without "
                      "rope_theta (fla/models/lightnet/modeling_lightnet.py)"),
    # transformers' BitNet (another model than FLA's) takes the key: the line names the other implementation
    "other-impl": ({"model_type": "bitnet", **SMALL, "attention_dropout": 0.0},
                   "attention_dropout is not a key of FLA's BitNetConfig: the class would ignore it; remove it or "
                   "correct its name, or pass --model.impl hf to train transformers' BitNetConfig's model, which "
                   "takes it (docs/models.md#config-keys)"),
    "hf-name": ({"model_type": "gla", **SMALL, "num_attention_heads": 4, "attn": {**SAMBA_ATTN, "num_key_value_heads": 2}},
                "attn.num_key_value_heads is not a key of FLA's GLAConfig's attn spec (did you mean num_kv_heads?)"),
    "no-other-impl": ({"model_type": "gla", **SMALL, "attention_dropout": 0.0},
                      "attention_dropout is not a key of FLA's GLAConfig: the class would ignore it; remove it or "
                      "correct its name (docs/models.md#config-keys)"),
    "typed-field": ({"model_type": "mamba2", **SMALL, "head_dim": 16, "flame_impl": "hf",
                     "time_step_limit": [0.0, "big"]},
                    "Mamba2Config refuses this config: Validation error for field 'time_step_limit'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_dry_run_refuses_a_key_the_class_would_drop(tmp_path, capsys, monkeypatch, case):
    config, message = REFUSED[case]
    path = tmp_path / "model.json"
    path.write_text(json.dumps(config))
    monkeypatch.setattr("sys.argv", ["flame.launch", "--model.config", str(path), "--job.dry_run"])
    assert main() == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {path}: {message}"), line


def test_accepted_values_build_what_fla_builds():
    """Keys FLA does not take pass only with the values that describe what FLA builds: the same model."""
    base = {"model_type": "gsa", **SMALL, "num_heads": 4}
    accepted = {
        "use_rope": False,
        "share_conv_kernel": True,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }
    args, plain = model_args_from_dict({**base, **accepted})[0], model_args_from_dict(base)[0]
    with torch.device("meta"):
        from flame.models import build_model

        shapes = [p.shape for p in build_model(args).parameters()]
        assert shapes == [p.shape for p in build_model(plain).parameters()]


def test_fla_tables_match_fla_classes_and_the_docs():
    """Each table entry names a key FLA 0.6.0's class does not take (else the class reads it itself) and, for
    renames and attributes, the parameter it does take; docs/models.md names every key."""
    doc = (REPO / "docs" / "models.md").read_text()
    named = []
    for model_type, renames in FLA_RENAMED_KEYS.items():
        taken = accepted_keys(config_class(model_type, "fla"))
        for old, (new, _) in renames.items():
            assert old not in taken and new in taken, (model_type, old, new)
            named += [old, new]
    for model_type, attributes in FLA_ATTRIBUTE_KEYS.items():
        cls = config_class(model_type, "fla")
        for attribute, parameter in attributes.items():
            assert attribute not in accepted_keys(cls) and parameter in accepted_keys(cls)
            assert getattr(cls(**{parameter: 0.25}), attribute) == 0.25
            named += [attribute]
    for model_type, settled in FLA_SETTLED_KEYS.items():
        if model_type != "*":
            assert not set(settled) & accepted_keys(config_class(model_type, "fla")), model_type
        named += list(settled)
    for model_type in FLA_UNREAD_ATTN_KEYS:
        assert "attn" in accepted_keys(config_class(model_type, "fla"))
    for model_type, settled in TRANSFORMERS_SETTLED_KEYS.items():
        cls = transformers_config_class(model_type)
        assert not set(settled) & accepted_keys(cls), model_type
        assert all(rule.same_as in accepted_keys(cls) for rule in settled.values() if rule.same_as)
        named += list(settled)
    for model_type, nested in FLA_NESTED_KEYS.items():
        assert set(nested) <= accepted_keys(config_class(model_type, "fla"))
        named += list(nested)
    assert [key for key in named if f"`{key}`" not in doc] == []
