"""Every model type FLA 0.6.0 registers with transformers builds through the generic family on the meta device
with the parameter count of FLA's own class (FLA's kernels need a GPU; building needs none), and a FLOPs count
between its weights' and a bound."""

import importlib
import warnings

import pytest
import torch

from flame.errors import ModelConfigError
from flame.models import FAMILIES, build_model, model_args_from_dict
from flame.models.common.module_flops import module_flops
from flame.models.layers.fla_attention import FLAAttention

TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2}
# FLA's defaults that do not fit a 64-wide model: heads of expand_ratio (128) channels leave no head at all.
OVERRIDES = {
    "hgrn2": {"expand_ratio": 16},
    "lightnet": {"expand_ratio": 16},
    "rodimus": {"ska_attn": {"num_heads": 4}},  # the rodimus_plus block's attention, required
    # Their kernels take heads of 16 channels or more (flame.models.generic.args.FLA_HEAD_WIDTHS): 4 of 16.
    "deltaformer": {"num_heads": 4},
    "path_attn": {"num_heads": 4},
    "samba": {"attn": {"layers": [1], "num_heads": 4}},  # the default 18 heads leave an odd head_dim for RoPE
}


def fla_model_types() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.models

    return sorted(getattr(fla.models, n).model_type for n in dir(fla.models) if n.endswith("Config"))


def fla_model(config: dict) -> torch.nn.Module:
    """FLA's own class for the config on the meta device, as it is built where flash-attn imports (FLA's attention
    layer only checks that the name flash_attn_func is bound)."""
    import fla.layers.attn
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fla.layers.attn, "flash_attn_func", object())
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **values))


def fla_params(config: dict) -> int:
    return sum(p.numel() for p in fla_model(config).parameters())


def test_every_fla_family_builds_with_fla_parameter_count():
    model_types = fla_model_types()
    assert len(model_types) >= 40
    counts, failed, blocks = {}, {}, {}
    for model_type in model_types:
        if model_type in FAMILIES:
            continue
        config = {"model_type": model_type, **TINY, **OVERRIDES.get(model_type, {})}
        args, unknown = model_args_from_dict(config)
        assert args.generic and unknown == [], (model_type, unknown)
        with torch.device("meta"):
            model = build_model(args)
        nparams, flops = args.get_nparams_and_flops(model, 64)
        counts[model_type] = nparams
        # FLOPs per token: at least the weights' (each used once), at most 5 x 6N at 64 tokens (the widest
        # default heads, Gated DeltaNet's 6 x 256 x 512 in a 64-wide model, cost 4.5 x 6N with their state terms);
        # MesaNet's default 16 heads of 128 channels solve for each query in 30 conjugate-gradient steps: 29 x 6N.
        ceiling = 35 if model_type == "mesa_net" else 5
        count = module_flops(model, [b for name in model.flame_blocks for b in model.get_submodule(name)], 64)
        assert count.total == flops and count.matmul_params <= nparams, model_type
        assert 6 * count.matmul_params <= flops <= ceiling * 6 * nparams, model_type
        # Every family's mixer has a term (docs/metrics.md); hgrn's elementwise scan is classified and adds nothing.
        assert count.uncounted == [], model_type
        assert (count.mixer_flops > 0) == (model_type != "hgrn"), model_type
        blocks[model_type] = model.flame_blocks
        if nparams != fla_params(config):
            failed[model_type] = (nparams, fla_params(config))
    assert failed == {}
    assert len(counts) == len(model_types) - len(FAMILIES)
    # Blocks are found from each class, wherever it keeps them (upstream flame issue 4: Mamba's backbone).
    assert blocks["gla"] == ["model.layers"] and blocks["mamba2"] == ["backbone.layers"]
    assert blocks["cat"] == ["model.compressor.layers", "model.layers"]  # two stacks of blocks


@pytest.mark.parametrize(
    ("model_type", "heads", "width"), [("deltaformer", 8, 8), ("deltaformer", 4, 24), ("path_attn", 2, 48)]
)
def test_head_widths_flas_kernels_refuse_are_refused_before_any_step(model_type, heads, width):
    """deltaformer's kernels need a power-of-2 head width (FLA 0.6.0's Triton compile error at its first step for 96:
    hidden 768 / 8 heads), path_attn's kernel asserts 16, 32, 64 or 128: refused when the config is read, in one
    line naming the width and how to choose num_heads; the widths they take build."""
    hidden = width * heads
    with pytest.raises(
        ModelConfigError, match=f"model_type '{model_type}'.*not {width} .*num_heads {heads}\\)"
    ):
        model_args_from_dict({"model_type": model_type, **TINY, "hidden_size": hidden, "num_heads": heads})
    args, _ = model_args_from_dict(
        {"model_type": model_type, **TINY, "hidden_size": 64 * heads, "num_heads": heads}
    )
    assert args.generic


def test_nsa_groups_its_kernels_refuse_are_refused_before_any_step():
    """NSA's kernels assert a power of 2 from 16 query heads per key/value head (FLA 0.6.0: at the first forward)."""
    for heads, kv_heads in ((32, 4), (48, 1), (16, 3)):
        with pytest.raises(
            ModelConfigError, match=f"model_type 'nsa'.*num_heads {heads} / num_kv_heads {kv_heads};"
        ):
            model_args_from_dict({"model_type": "nsa", **TINY, "num_heads": heads, "num_kv_heads": kv_heads})
    for heads, kv_heads in ((16, 1), (64, 4), (32, 1)):
        assert model_args_from_dict(
            {"model_type": "nsa", **TINY, "num_heads": heads, "num_kv_heads": kv_heads}
        )[0].generic


def test_flame_builds_its_own_families_not_flas():
    for model_type in FAMILIES:  # flame's own implementation, not FLA's class
        args, _ = model_args_from_dict({"model_type": model_type, **TINY})
        assert not args.generic


def test_an_fla_layer_that_refuses_to_be_built_without_flash_attn_is_named_in_one_line(monkeypatch):
    """FLA 0.6.0's MLA refuses to be built while its module holds no flash_attn_func; flame gives it flame's
    (below). Without that, the build stops with one line naming the layer."""
    import fla.layers.mla

    from flame.models.generic import model as generic_model

    monkeypatch.setattr(generic_model, "fla_flash_attn_calls_on_flame", lambda functions: None)
    monkeypatch.setattr(fla.layers.mla, "flash_attn_func", None)
    args, _ = model_args_from_dict({"model_type": "mla", **TINY})
    with torch.device("meta"), pytest.raises(ModelConfigError, match="'mla' needs flash-attn") as e:
        build_model(args)
    assert "fla.layers.mla.MultiheadLatentAttention" in str(e.value)


@pytest.mark.parametrize("model_type", ["nsa", "rodimus", "moba", "mla"])
def test_flash_attn_callers_run_on_flames_functions_without_flash_attn(model_type):
    """FLA's rodimus, NSA, MoBA and MLA modules call flash-attn's functions (MoBA its parallel_moba too): without
    flash-attn, once such a family is built, they call flame's (tests/models/layers/test_fla_attention.py and
    test_fla_moba.py check those)."""
    from flame.compat import FLA_FLASH_ATTN_CALLERS
    from flame.models.layers import fla_attention, fla_moba

    args, _ = model_args_from_dict({"model_type": model_type, **TINY, **OVERRIDES.get(model_type, {})})
    with torch.device("meta"):
        build_model(args)
    for module_name in FLA_FLASH_ATTN_CALLERS:
        module = importlib.import_module(module_name)
        assert module.flash_attn_func is fla_attention.flash_attn_func, module_name
        assert module.flash_attn_varlen_func is fla_attention.flash_attn_varlen_func, module_name
    assert importlib.import_module("fla.layers.moba").parallel_moba is fla_moba.parallel_moba


def test_moba_layers_pass_their_rows_length_to_flames_op(monkeypatch):
    """Built by flame without flash-attn, FLA's MoBA layers keep no max_position_embeddings, so they pass
    parallel_moba their rows' length, not max(length, max_position_embeddings): flame's op then attends the rows in
    one call without reading cu_seqlens (a compiled block cannot read it). A 200-token batch against the config's
    2048."""
    import fla.layers.moba

    from flame.models.layers import fla_moba

    args, _ = model_args_from_dict({"model_type": "moba", **TINY, "max_position_embeddings": 2048})
    with torch.device("meta"):
        model = build_model(args)
    layers = [m for m in model.modules() if isinstance(m, fla.layers.moba.MoBA)]
    assert len(layers) == TINY["num_hidden_layers"]
    assert all(layer.max_position_embeddings is None for layer in layers)
    calls = []
    monkeypatch.setattr(fla.layers.moba, "parallel_moba", lambda q, k, v, **kw: calls.append(kw) or q)
    # FLA's norms and rotary embedding as flame's PyTorch code, which runs on the meta device.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layers[0](torch.empty(2, 200, TINY["hidden_size"], device="meta"))
    assert calls[0]["max_seqlen"] == 200 and tuple(calls[0]["cu_seqlens"].shape) == (3,)
    assert fla_moba.parallel_moba is not fla.layers.moba.parallel_moba  # the monkeypatch, undone after


@pytest.mark.parametrize("block_residual_in_fp32", [False, True])
def test_rodimus_blocks_pass_the_residual_as_the_model_does(block_residual_in_fp32):
    """FLA 0.6.0's RodimusBlock reads its residual flag from residual_in_fp32 (default True), its model from
    block_residual_in_fp32 (default False): built by flame (and, after that, by FLA's own class) the blocks follow
    the model, so the default config does not stop at its second block."""
    from fla.models import RodimusConfig, RodimusForCausalLM

    config = {
        "model_type": "rodimus",
        **TINY,
        **OVERRIDES["rodimus"],
        "block_residual_in_fp32": block_residual_in_fp32,
    }
    args, _ = model_args_from_dict(config)
    with torch.device("meta"):
        flame_model = build_model(args)
        fla_config = RodimusConfig(
            **TINY, **OVERRIDES["rodimus"], block_residual_in_fp32=block_residual_in_fp32
        )
        fla_class = RodimusForCausalLM(fla_config)
    for model in (flame_model, fla_class):
        assert model.model.block_residual_in_fp32 is block_residual_in_fp32
        assert [block.block_residual_in_fp32 for block in model.model.layers] == [block_residual_in_fp32] * 2


ATTENTION_CONFIGS = {
    "transformer": {"model_type": "transformer", **TINY, "num_heads": 4, "num_kv_heads": 2, "qk_norm": True,
                    "qkv_bias": True, "window_size": 16},
    "samba": {"model_type": "samba", **TINY, **OVERRIDES["samba"]},
    "gla": {"model_type": "gla", **TINY, "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True,
                                                    "window_size": 8}},
    "bitnet": {"model_type": "bitnet", **TINY},
}  # fmt: skip


@pytest.mark.parametrize("name", ATTENTION_CONFIGS)
def test_attention_layers_on_flame_have_the_state_dict_of_fla_classes(name):
    config = ATTENTION_CONFIGS[name]
    args, unknown = model_args_from_dict(config, impl="fla")
    assert unknown == []
    with torch.device("meta"):
        model = build_model(args)
    assert any(isinstance(m, FLAAttention) for m in model.modules())
    reference = fla_model(config)
    assert not any(isinstance(m, FLAAttention) for m in reference.modules())
    assert any(type(m).__module__ in ("fla.layers.attn", "fla.layers.bitattn") for m in reference.modules())

    def layout(m):
        return {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()}

    assert layout(model) == layout(reference)


def test_fla_layers_are_fla_own_where_flash_attn_imports(monkeypatch):
    import fla.layers.attn

    monkeypatch.setattr(
        fla.layers.attn, "flash_attn_func", object()
    )  # what FLA's import sets where it exists
    args, _ = model_args_from_dict(ATTENTION_CONFIGS["gla"], impl="fla")
    with torch.device("meta"):
        model = build_model(args)
    assert type(model.model.layers[1].attn) is fla.layers.attn.Attention


def test_mom_gives_the_load_balancing_its_class_adds_to_its_loss():
    """FLA's MoM adds aux_loss_scale x its routers' load balancing whenever it computes its loss; flame's generic
    model hands the same term to the training step (FLA's function on random router logits, on the CPU)."""
    from fla.models.mom.modeling_mom import MomCausalLMOutputWithPast, load_balancing_loss_func

    from flame.models import build_model, model_args_from_dict
    from flame.models.generic.model import class_auxiliary_loss

    config = {"model_type": "mom", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2,
              "num_memories": 4, "topk": 2, "aux_loss_scale": 0.05}  # fmt: skip
    args, _ = model_args_from_dict(config)
    with torch.device("meta"):
        model = build_model(args)
    generator = torch.Generator().manual_seed(0)
    routers = tuple(torch.randn(30, 4, generator=generator) for _ in range(2))
    output = MomCausalLMOutputWithPast(logits=torch.zeros(1), router_logits=routers)
    expected = 0.05 * load_balancing_loss_func(routers, 4, 2)
    assert torch.equal(class_auxiliary_loss(model, output), expected) and expected > 0


@pytest.mark.parametrize("model_type", ["samba", "bitnet", "mla"])
def test_fla_classes_build_as_flame_builds_them_without_flash_attn(model_type):
    """FLA's own class (what the bench's naive loop and export check build) needs flash-attn for these families;
    inside fla_classes_as_flame_builds_them it builds without it, with the parameters of flame's model of the same
    config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from flame.models.generic.args import import_fla_models
    from flame.models.generic.model import fla_classes_as_flame_builds_them

    import_fla_models()
    fields = {"model_type": model_type, **TINY, **OVERRIDES.get(model_type, {})}
    config = AutoConfig.for_model(**fields)
    with torch.device("meta"), fla_classes_as_flame_builds_them():
        theirs = AutoModelForCausalLM.from_config(config)
    args, _ = model_args_from_dict(fields)
    with torch.device("meta"):
        ours = build_model(args)
    assert type(theirs).__module__.startswith("fla.models.")
    assert {name: p.shape for name, p in theirs.named_parameters()} == {
        name: p.shape for name, p in ours.named_parameters()
    }


def test_mamba3_passes_the_device_check_without_mamba_ssm():
    """FLA's Mamba3 layer runs only on mamba_ssm's kernels; flame's layer in its place runs SISO and MIMO layers
    (is_mimo) on flame's scans, so neither is refused where mamba_ssm is not installed."""
    from flame.models import check_device

    assert importlib.util.find_spec("mamba_ssm") is None
    for mimo in (False, True):
        check_device(model_args_from_dict({"model_type": "mamba3", "is_mimo": mimo, **TINY})[0], "cuda")


def test_log_linear_mamba2_passes_its_level_scales_in_the_inputs_dtype(monkeypatch):
    """FLA's LogLinearMamba2 hands its float32 level scales to a kernel that takes them in the inputs' dtype: after
    flame's fix the layer's module casts them (the kernel itself: the Hopper compile test below)."""
    import fla.layers.log_linear_mamba2 as layer_module

    from flame import compat

    seen = {}

    def chunk_log_linear_attn(q, k, v, g, level_scales, initial_state=None, **kwargs):
        seen.update(q=q.dtype, level_scales=level_scales.dtype)
        return q, None

    monkeypatch.setattr(layer_module, "chunk_log_linear_attn", chunk_log_linear_attn)
    compat.fla_log_linear_scales_in_the_inputs_dtype()
    compat.fla_log_linear_scales_in_the_inputs_dtype()  # idempotent: one cast
    q = torch.zeros(1, 8, 1, 16, dtype=torch.bfloat16)
    scales = torch.ones(1, 8, 2, 4, requires_grad=True)
    layer_module.chunk_log_linear_attn(q=q, k=q, v=q, g=q.float(), level_scales=scales, scale=1.0)
    assert seen == {"q": torch.bfloat16, "level_scales": torch.bfloat16}


def test_flas_log_linear_forward_kernel_compiles_for_hopper_only_with_scales_in_the_inputs_dtype():
    """Triton compiles FLA 0.6.0's log-linear forward kernel for sm_90 on this machine (ptxas ships with Triton):
    with bf16 inputs and float32 level scales, what FLA's layer passes under autocast, it stops at "177:18" as on an
    H200; with the scales in bf16, what flame passes, it compiles."""
    import triton
    from fla.ops.log_linear_attn import chunk
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = chunk.chunkwise_fwd_kernel
    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # inside FLA's autotuner and heuristics
        kernel = kernel.fn
    constexprs = dict(G=1, H=4, K=64, V=64, L=12, BT=64, BK=64, L_IN=1, L_OUT=1, MIN_LEVEL=0, MAX_LEVEL=10,
                      IS_VARLEN=False, USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, SCALE=1.0)  # fmt: skip
    integers = ("llut", "offsets", "new_offsets", "cu_seqlens", "output_cu_seqlens")

    def compiled(scales_dtype: str):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in ("T", "output_T", "stride_o_n"):
                signature[name] = "i32"
            elif name in integers:
                signature[name] = "*i32"
            elif name == "level_scales":
                signature[name] = f"*{scales_dtype}"
            else:
                signature[name] = "*fp32" if name == "g" else "*bf16"
        source = ASTSource(kernel, signature, constexprs=constexprs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))

    assert compiled("bf16").asm["cubin"]
    with pytest.raises(triton.compiler.errors.CompilationError, match="at 177:18"):
        compiled("fp32")


def test_log_linear_attention_builds_its_level_masks_once():
    """FLA's level lookup table and masks, rebuilt on the host at every call: after flame's fix the same tensors
    come back for a chunk size and device, equal to what FLA builds."""
    from fla.ops.log_linear_attn import chunk

    from flame import compat

    built = {name: getattr(chunk, name) for name in ("level_lut", "masks")}
    built = {name: getattr(function, "__wrapped__", function) for name, function in built.items()}
    compat.fla_log_linear_masks_built_once()
    compat.fla_log_linear_masks_built_once()  # idempotent: one cache
    cpu = torch.device("cpu")
    for name, build in built.items():
        cached = getattr(chunk, name)
        assert cached(16, cpu) is cached(16, cpu), name
        assert torch.equal(cached(16, cpu), build(16, cpu)), name
        assert cached(32, cpu).shape != cached(16, cpu).shape, name
        assert getattr(cached.__wrapped__, "cache_info", None) is None, name
