"""FLA's classes whose blocks flame compiles (FLA_MODEL_TYPES_TRACED_WHOLE: mamba, mamba2, mamba3 SISO and MIMO, samba, moba),
and those whose CUDA graphs capture their blocks compiled around FLA's mixer ops (nsa, wall_transformer, parallax,
stick-breaking attention), give the eager model's results: per-block torch.compile (FLA's norms and activations as flame's PyTorch code, the
selective scan and Mamba-2's scan as flame's custom ops) against the same model run eagerly (FLA's Triton norms and activations), float32, odd sizes; and flame's
PyTorch versions of FLA's functions against FLA's kernels on random inputs.

Tolerances: float32 (parallax's and stick-breaking attention's kernels take bf16 only: their test states its own
tolerances); the compiled and eager models differ only in the order of float32 sums (inductor's
reductions, FLA's kernels), so loss, logits and gradients agree to a relative 1e-4 of their norms (a wrong
residual, eps, gate or cast gives errors of order 1e-2 or more). The functions agree to 1e-5 (float32) and one
bfloat16 ulp (bfloat16 inputs, float32 compute in both)."""

import importlib.util

import pytest
import torch

from flame.models import build_model, model_args_from_dict, model_spec
from flame.models.generic.args import fla_blocks_run_eagerly
from flame.models.generic.model import FLA_FUNCTIONS_IN_PYTORCH

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("mamba_ssm") is not None, reason="mamba_ssm's kernels serve Mamba"
    ),
]

MODELS = {
    "mamba": {"model_type": "mamba", "vocab_size": 509, "hidden_size": 96, "num_hidden_layers": 3},
    "samba": {"model_type": "samba", "vocab_size": 509, "hidden_size": 96, "num_hidden_layers": 3,
              "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": 2048}},
    # 384-token rows of 128-token blocks: the compiled op is FlexAttention (fla_moba.flex_serves)
    "moba": {"model_type": "moba", "vocab_size": 509, "hidden_size": 128, "num_hidden_layers": 3,
             "num_heads": 4, "num_kv_heads": 2, "moba_chunk_size": 128, "moba_topk": 3},
    "mamba2": {"model_type": "mamba2", "vocab_size": 509, "hidden_size": 96, "num_hidden_layers": 3, "head_dim": 48,
               "state_size": 32, "n_groups": 2},
    "mamba3": {"model_type": "mamba3", "vocab_size": 509, "hidden_size": 96, "num_hidden_layers": 3, "head_dim": 48,
               "state_size": 32, "n_groups": 2},
    "mamba3_mimo": {"model_type": "mamba3", "vocab_size": 509, "hidden_size": 96, "num_hidden_layers": 3,
                    "head_dim": 48, "state_size": 32, "n_groups": 2, "is_mimo": True, "mimo_rank": 2},
}  # fmt: skip
TOKENS = {"moba": 384}


def relative(reference: torch.Tensor, other: torch.Tensor) -> float:
    reference, other = reference.double(), other.double()
    return ((reference - other).norm() / reference.norm()).item()


def loss_and_gradients(model, tokens):
    logits = model(tokens)
    logits = logits.logits if hasattr(logits, "logits") else logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    model.zero_grad(set_to_none=True)
    loss.backward()
    return (
        loss.detach(),
        logits.detach(),
        # A compiled block's parameters are named through its wrapper's ``_orig_mod``.
        {
            n.replace("._orig_mod", ""): p.grad.clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        },
    )


# Models whose scan multiplies float32 in FLA's Triton kernels, which round products to TF32 by default: they run
# with IEEE float32 products (exact_float32, fla_tilelang_off), without which their compiled and eager gradients
# differed by up to 7.6e-4 relative (H200, 2026-12-02): TF32 rounding of inputs that differ in their last bits.
TRITON_FLOAT32_SCANS = ("mamba2", "mamba3", "mamba3_mimo")


@pytest.mark.parametrize("name", MODELS)
def test_compiled_blocks_match_the_eager_model(name, monkeypatch, request):
    from flame.models.layers import fla_moba

    if name in TRITON_FLOAT32_SCANS:
        request.getfixturevalue("exact_float32")
        request.getfixturevalue("fla_tilelang_off")

    args, _ = model_args_from_dict(MODELS[name])
    assert fla_blocks_run_eagerly(args) is None
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    tokens = torch.randint(
        0,
        args.vocab_size,
        (2, TOKENS.get(name, 203)),
        device="cuda",
        generator=torch.Generator("cuda").manual_seed(1),
    )
    eager = loss_and_gradients(model, tokens)

    torch._dynamo.reset()
    flex_answers = []
    flex_serves = fla_moba.flex_serves
    monkeypatch.setattr(
        fla_moba, "flex_serves", lambda *a: flex_answers.append(flex_serves(*a)) or flex_answers[-1]
    )
    for stack in model_spec(args).blocks(model):
        for layer_id, block in stack.named_children():
            stack.register_module(layer_id, torch.compile(block, fullgraph=True))
    compiled = loss_and_gradients(model, tokens)
    assert all(flex_answers) and len(flex_answers) == (args.num_hidden_layers if name == "moba" else 0)

    assert relative(eager[0], compiled[0]) < 1e-4
    assert relative(eager[1], compiled[1]) < 1e-4
    assert eager[2].keys() == compiled[2].keys() and len(eager[2]) > 10
    worst = max(eager[2], key=lambda n: relative(eager[2][n], compiled[2][n]))
    assert relative(eager[2][worst], compiled[2][worst]) < 1e-4, worst


# FLA's classes whose blocks run eagerly (fla_blocks_run_eagerly) and replay as CUDA graphs of the blocks compiled
# (--compile.compile_graphed_blocks): inductor compiles the code around FLA's mixer op, which dynamo calls rather
# than traces (marked torch.compiler.disable by FLA or by compat.fla_ops_opaque_to_compile). The family table's
# width (768), two blocks; FLA refuses float32 in parallax's and stick-breaking attention's kernels, so those two
# run under bf16 autocast, compiled and eager alike.
OPAQUE_OP_MODELS = {
    name: {"model_type": name, "vocab_size": 509, "hidden_size": 768, "num_hidden_layers": 2}
    for name in ("nsa", "wall_transformer", "parallax", "stickbreaking_attn")
}
BF16_ONLY = ("parallax", "stickbreaking_attn")


@pytest.mark.parametrize("name", OPAQUE_OP_MODELS)
def test_blocks_compiled_around_flas_ops_match_the_eager_model(name, exact_float32):
    """Float32, with IEEE products in FLA's Triton kernels too (in TF32 nsa's and wall_transformer's gradients are
    1.1e-4 and 3.0e-4 apart, H200): loss, logits and gradients to 1e-4 relative, as above. Under bf16 autocast the
    compiled norms and MLP round differently from FLA's kernels (one bf16 ulp, 2**-8, per element): loss to 1e-2,
    logits and gradients to 5e-2 relative; a NaN, a dropped residual or gate, or a kernel traced into and recompiled
    wrongly is off by far more."""
    args, _ = model_args_from_dict(OPAQUE_OP_MODELS[name])
    assert fla_blocks_run_eagerly(args) is not None
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    tokens = torch.randint(
        0, args.vocab_size, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=name in BF16_ONLY)
    with autocast:
        eager = loss_and_gradients(model, tokens)
    torch._dynamo.reset()
    for stack in model_spec(args).blocks(model):
        for layer_id, block in stack.named_children():
            stack.register_module(layer_id, torch.compile(block))
    with autocast:
        compiled = loss_and_gradients(model, tokens)
    loss_tolerance, tolerance = (1e-2, 5e-2) if name in BF16_ONLY else (1e-4, 1e-4)
    assert torch.isfinite(compiled[0])
    assert relative(eager[0], compiled[0]) < loss_tolerance
    assert relative(eager[1].float(), compiled[1].float()) < tolerance
    assert eager[2].keys() == compiled[2].keys() and len(eager[2]) > 10
    worst = max(eager[2], key=lambda n: relative(eager[2][n], compiled[2][n]))
    assert relative(eager[2][worst], compiled[2][worst]) < tolerance, worst


def fla_function(dotted: str):
    import importlib

    from flame.compat import fla_functions_traced_under_compile

    fla_functions_traced_under_compile(FLA_FUNCTIONS_IN_PYTORCH)
    module_name, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), name)


def arguments(dotted: str, dtype: torch.dtype) -> tuple[tuple, dict]:
    generator = torch.Generator("cuda").manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=generator)

    x, y = randn(3, 37, 83), randn(3, 37, 83)
    name = dotted.rsplit(".", 1)[1]
    if name == "rms_norm":
        return (x, randn(83, dt=torch.float32), randn(83, dt=torch.float32)), {
            "residual": y, "eps": 1e-5, "prenorm": True, "residual_in_fp32": True}  # fmt: skip
    if name == "rmsnorm_fn":  # Mamba2's norm: the gate before the norm
        return (x, randn(83, dt=torch.float32), randn(83, dt=torch.float32)), {
            "z": y, "eps": 1e-5, "norm_before_gate": False}  # fmt: skip
    if name in ("swiglu",):
        return (x, y), {}
    if name == "swiglu_linear":
        return (x, y, randn(29, 83), randn(29)), {}
    if name == "rotary_embedding":  # 48 of 64 channels rotate; positions 3.. of a 45-row table
        angles = torch.rand(45, 24, device="cuda", generator=generator, dtype=torch.float64) * 40
        return (randn(3, 37, 5, 64), angles.cos().to(dtype), angles.sin().to(dtype)), {"seqlen_offsets": 3}
    return (x,), {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dotted", list(FLA_FUNCTIONS_IN_PYTORCH))
def test_pytorch_versions_match_flas_kernels(dotted, dtype):
    fla_function(dotted)  # installs the wrappers
    args, kwargs = arguments(dotted, dtype)
    leaves = [a.clone().requires_grad_() for a in args]
    wrapped = fla_function(dotted)
    kernel_out = wrapped(*leaves, **kwargs)  # eager: FLA's kernel
    torch_out = FLA_FUNCTIONS_IN_PYTORCH[dotted](*args, **kwargs)
    kernel_out = kernel_out if isinstance(kernel_out, tuple) else (kernel_out,)
    torch_out = torch_out if isinstance(torch_out, tuple) else (torch_out,)
    assert [t.dtype for t in kernel_out] == [t.dtype for t in torch_out]
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-7, 1e-2)
    for kernel, ours in zip(kernel_out, torch_out):
        torch.testing.assert_close(
            ours.float(), kernel.float(), rtol=rtol, atol=atol * kernel.abs().max().item()
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["interleaved", "offsets_per_sequence", "packed_documents"])
def test_rotary_embedding_matches_flas_kernel_forward_and_backward(case, dtype):
    """flame's rotary embedding (flame/ops/rotary.py) against FLA's Triton kernel and its backward (the conjugate
    rotation): outputs and input gradients, float32 to 1e-5 and bfloat16 to one ulp."""
    from flame.ops.rotary import rotary_embedding

    kernel = fla_function("fla.modules.rotary.ops.rotary_embedding")
    generator = torch.Generator("cuda").manual_seed(2)
    batch, kwargs = 3, {}
    if case == "interleaved":
        kwargs = {"interleaved": True}
    elif case == "offsets_per_sequence":
        kwargs = {"seqlen_offsets": torch.tensor([0, 5, 11], device="cuda")}
    else:
        batch, kwargs = 1, {"cu_seqlens": torch.tensor([0, 9, 10, 40, 53], device="cuda", dtype=torch.int32)}
    x = torch.randn(batch, 53 if batch == 1 else 37, 5, 64, device="cuda", generator=generator).to(dtype)
    angles = torch.rand(70, 32, device="cuda", generator=generator, dtype=torch.float64) * 60
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grad = torch.randn(x.shape, device="cuda", generator=generator).to(dtype)
    results = []
    for function in (kernel, rotary_embedding):
        leaf = x.clone().requires_grad_()
        out = function(leaf, cos, sin, **kwargs)
        out.backward(grad)
        results.append((out.float(), leaf.grad.float()))
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-7, 1e-2)
    for theirs, ours in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol * theirs.abs().max().item())
