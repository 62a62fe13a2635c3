"""Every model type FLA 0.6.0 registers with transformers builds through the generic family on the meta device
with the parameter count of FLA's own class (FLA's kernels need a GPU; building needs none), and a FLOPs count
between its weights' and a bound."""

import warnings

import pytest
import torch

from flame.models import FAMILIES, build_model, model_args_from_dict
from flame.models.common.module_flops import module_flops

TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2}
# FLA's defaults that do not fit a 64-wide model: heads of expand_ratio (128) channels leave no head at all.
OVERRIDES = {
    "hgrn2": {"expand_ratio": 16},
    "lightnet": {"expand_ratio": 16},
    "rodimus": {"ska_attn": {"num_heads": 4}},  # the rodimus_plus block's attention, required
}
# FLA's layers for these import flash_attn when they are built, which flame does not install.
NEEDS_FLASH_ATTN = {"mla", "samba"}
# Families whose mixer has no term in flame's FLOPs count (docs/metrics.md): elementwise scans, sparse or modified
# attention, other recurrences; their count is their weights' and convolutions'.
MATMULS_ONLY = {
    "cat": "fla.models.cat.modeling_cat.CATDecoderAttention",
    "cyclic_flow_attention": "fla.layers.cyfa.CyclicFlowAttention",
    "deltaformer": "fla.layers.deltaformer.DeltaFormerAttention",
    "hgrn": "fla.layers.hgrn.HGRNAttention",
    "log_linear_mamba2": "fla.layers.log_linear_mamba2.LogLinearMamba2",
    "mamba": "fla.layers.mamba.Mamba",
    "mamba3": "fla.layers.mamba3.Mamba3",
    "mesa_net": "fla.layers.mesa_net.MesaNet",
    "moba": "fla.layers.moba.MoBA",
    "nsa": "fla.layers.nsa.NativeSparseAttention",
    "parallax": "fla.layers.parallax.Parallax",
    "path_attn": "fla.layers.path_attn.PaTHAttention",
    "raven": "fla.layers.raven.Raven",
    "rodimus": "fla.layers.rodimus.RodimusAttention",  # its sliding-window attention is counted
}


def fla_model_types() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.models

    return sorted(getattr(fla.models, n).model_type for n in dir(fla.models) if n.endswith("Config"))


def fla_params(config: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **values))
    return sum(p.numel() for p in model.parameters())


def test_every_fla_family_builds_with_fla_parameter_count():
    model_types = fla_model_types()
    assert len(model_types) >= 40
    counts, failed, blocks = {}, {}, {}
    for model_type in model_types:
        if model_type in FAMILIES or model_type in NEEDS_FLASH_ATTN:
            continue
        config = {"model_type": model_type, **TINY, **OVERRIDES.get(model_type, {})}
        args, unknown = model_args_from_dict(config)
        assert args.generic and unknown == [], (model_type, unknown)
        with torch.device("meta"):
            model = build_model(args)
        nparams, flops = args.get_nparams_and_flops(model, 64)
        counts[model_type] = nparams
        # FLOPs per token: at least the weights' (each used once), at most 5 x 6N at 64 tokens (the widest
        # default heads, Gated DeltaNet's 6 x 256 x 512 in a 64-wide model, cost 4.5 x 6N with their state terms).
        count = module_flops(model, [b for name in model.flame_blocks for b in model.get_submodule(name)], 64)
        assert count.total == flops and count.matmul_params <= nparams, model_type
        assert 6 * count.matmul_params <= flops <= 5 * 6 * nparams, model_type
        expected = [MATMULS_ONLY[model_type]] if model_type in MATMULS_ONLY else []
        assert count.uncounted == expected, model_type
        assert (count.mixer_flops > 0) == (not expected or model_type == "rodimus"), model_type
        blocks[model_type] = model.flame_blocks
        if nparams != fla_params(config):
            failed[model_type] = (nparams, fla_params(config))
    assert failed == {}
    assert len(counts) == len(model_types) - len(FAMILIES) - len(NEEDS_FLASH_ATTN)
    # Blocks are found from each class, wherever it keeps them (upstream flame issue 4: Mamba's backbone).
    assert blocks["gla"] == ["model.layers"] and blocks["mamba2"] == ["backbone.layers"]
    assert blocks["cat"] == ["model.compressor.layers", "model.layers"]  # two stacks of blocks


def test_flame_builds_its_own_families_and_flash_attn_families_say_so():
    for model_type in FAMILIES:  # flame's own implementation, not FLA's class
        args, _ = model_args_from_dict({"model_type": model_type, **TINY})
        assert not args.generic
    for model_type in sorted(NEEDS_FLASH_ATTN):
        args, _ = model_args_from_dict({"model_type": model_type, **TINY})
        with torch.device("meta"), pytest.raises(ImportError, match="[Ff]lash"):
            build_model(args)
