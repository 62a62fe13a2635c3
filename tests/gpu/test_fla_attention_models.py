"""FLA's transformer (--model.impl fla) and samba built by flame's generic family run their attention layers on
flame's attention where flash-attn is not importable: a bf16 forward and backward of the whole model on the GPU
(FLA's Triton norms, MLPs and Mamba around flame's layer), and the attention layer's output inside it against the
float64 attention of tests/models/layers/test_fla_attention.py on the same inputs and weights; rodimus, NSA and MoBA,
which call flame's flash_attn_func and parallel_moba there, train a bf16 step, and flame's flash-attn functions
match flash-attn's semantics in bf16."""

import importlib.util

import pytest
import torch

from flame.models import build_model, model_args_from_dict
from flame.models.layers.fla_attention import FLAAttention
from tests.models.layers.test_fla_attention import naive

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("flash_attn") is not None, reason="flash-attn imports: FLA's own layers run"
    ),
]

# Relative error (norm of the difference over the norm of the reference) of the bf16 layer, as in
# test_model_parity.py: bf16 rounds q, k, v, the rotary tables and the output (~0.4% each); a wrong mask, rotation
# or head mapping gives errors of order one. float32 layers agree to ~1e-6 without TF32 (exact_float32: FLA's
# parallel_attn, which serves windows, multiplies float32 in TF32 by Triton's default).
BF16_LIMIT = 0.02
FP32_LIMIT = 1e-4
TINY = {"vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2}
MODELS = {
    "transformer": {"model_type": "transformer", **TINY, "num_heads": 4, "num_kv_heads": 2, "qk_norm": True,
                    "window_size": 48},
    "samba": {"model_type": "samba", **TINY, "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 1,
                                                      "window_size": 2048}},
}  # fmt: skip


def err_ratio(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((ref - out).norm() / ref.norm()).item()


@pytest.mark.parametrize("name", MODELS)
def test_fla_model_trains_in_bf16_with_attention_on_flame(name):
    args, _ = model_args_from_dict(MODELS[name], impl="fla")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    model = model.to(torch.bfloat16).train()
    layers = [m for m in model.modules() if isinstance(m, FLAAttention)]
    assert layers
    seen = {}

    def keep(module, inputs, kwargs, output):
        seen["x"], seen["out"] = kwargs.get("hidden_states", inputs[0] if inputs else None), output[0]

    handle = layers[0].register_forward_hook(keep, with_kwargs=True)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 100), device="cuda")
    logits = model(input_ids)
    handle.remove()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for param in layers[0].parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0

    reference = torch.stack([naive(layers[0].cpu(), row) for row in seen["x"].detach().cpu()])
    assert err_ratio(reference, seen["out"].detach().cpu()) < BF16_LIMIT


def test_fla_attention_layer_float32_on_gpu(exact_float32):
    torch.manual_seed(0)
    layer = FLAAttention(
        hidden_size=96, num_heads=6, num_kv_heads=2, qk_norm=True, qkv_bias=True, window_size=37
    )
    x = torch.randn(2, 101, 96)
    reference = torch.stack([naive(layer, row) for row in x])
    out, _, _ = layer.cuda()(x.cuda())
    assert err_ratio(reference, out.cpu()) < FP32_LIMIT
    packed, _, _ = layer(
        x[:1].cuda(), cu_seqlens=torch.tensor([0, 40, 101], device="cuda", dtype=torch.int32)
    )
    alone = torch.cat([layer(x[:1, :40].cuda())[0], layer(x[:1, 40:].cuda())[0]], dim=1)
    assert err_ratio(alone.cpu(), packed.cpu()) < FP32_LIMIT


def test_deltaformer_attention_on_flame_equals_flas_naive_op():
    """FLA's DeltaFormer op with its last step on flame's attention (flame.compat.fla_deltaformer_on_flame) against
    FLA's naive_deltaformer_attn, float32 inputs of odd sizes: outputs and input gradients within a relative 0.01
    (FLA's Triton u multiplies in TF32; a wrong scale, mask or step order differs by order one)."""
    from fla.ops.deltaformer.naive import naive_deltaformer_attn

    from flame.models.layers.fla_attention import deltaformer_attention

    generator = torch.Generator("cuda").manual_seed(0)
    shape = (2, 301, 3, 64)
    inputs = [torch.randn(shape, device="cuda", generator=generator) for _ in range(3)]
    inputs.append(torch.rand(shape[:3], device="cuda", generator=generator))
    grad = torch.randn(shape, device="cuda", generator=generator)
    results = []
    for op in (deltaformer_attention, naive_deltaformer_attn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = op(*leaves)
        out.backward(grad)
        results.append([out, *(x.grad for x in leaves)])
    for name, ours, reference in zip(("o", "dq", "dk", "dv", "dbeta"), *results, strict=True):
        assert err_ratio(reference, ours) < 0.01, name


FLASH_ATTN_CALLERS = {
    "rodimus": (
        {"model_type": "rodimus", **TINY, "ska_attn": {"num_heads": 4}},
        "SlidingWindowSharedKeyAttention",
    ),
    # NSA's kernels take groups of a power of 2 >= 16 query heads per key/value head
    "nsa": (
        {"model_type": "nsa", **TINY, "num_heads": 16, "num_kv_heads": 1, "head_dim": 64, "window_size": 32},
        "NativeSparseAttention",
    ),
    "moba": ({"model_type": "moba", **TINY, "moba_chunk_size": 16, "moba_topk": 3}, "MoBA"),
    "mla": (
        {"model_type": "mla", **TINY, "num_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
         "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "qk_head_dim": 48, "v_head_dim": 32},
        "MultiheadLatentAttention",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", FLASH_ATTN_CALLERS)
def test_fla_flash_attn_callers_train_in_bf16_on_flames_functions(name):
    """rodimus and NSA call flash-attn's functions for their sliding windows, MoBA its parallel_moba; without
    flash-attn, flame's (flame.compat.fla_flash_attn_calls_on_flame, fla_moba_on_flame): a bf16 forward and backward
    of the whole model, finite, every parameter of the layers that call them given a finite gradient."""
    config, layer_class = FLASH_ATTN_CALLERS[name]
    args, _ = model_args_from_dict(config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    model = model.to(torch.bfloat16).train()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 100), device="cuda")
    logits = model(input_ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    layers = [m for m in model.modules() if type(m).__name__ == layer_class]
    assert layers
    for layer in layers:
        for param_name, param in layer.named_parameters():
            assert param.grad is not None and torch.isfinite(param.grad).all(), param_name


def test_flash_attn_func_on_flame_in_bf16_equals_flash_attns_semantics():
    from flame.models.layers.fla_attention import flash_attn_func, flash_attn_varlen_func
    from tests.models.layers.test_fla_attention import naive_flash_attention

    generator = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(2, 301, 8, 64, device="cuda", generator=generator, dtype=torch.bfloat16)
    k, v = (
        torch.randn(2, 301, 2, 64, device="cuda", generator=generator, dtype=torch.bfloat16) for _ in range(2)
    )
    out = flash_attn_func(q, k, v, causal=True, window_size=(63, 0))
    assert err_ratio(naive_flash_attention(q.cpu(), k.cpu(), v.cpu(), True, 63), out.cpu()) < BF16_LIMIT
    cu = torch.tensor([0, 100, 101, 301], device="cuda", dtype=torch.int32)
    packed = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 200, 200, causal=True, window_size=(63, 0))
    want = naive_flash_attention(q[:1].cpu(), k[:1].cpu(), v[:1].cpu(), True, 63, cu_seqlens=cu.cpu())[0]
    assert err_ratio(want, packed.cpu()) < BF16_LIMIT


@pytest.mark.parametrize("lengths", [[300, 300], [200, 301]])
def test_parallel_moba_on_the_gpu_equals_the_pattern_written_out(lengths, exact_float32):
    """flame's parallel_moba in float32 on the GPU (SDPA's fused kernels with MoBA's mask; rows of one length in one
    call) against MoBA's pattern written out in float64: output and gradients."""
    from flame.models.layers.fla_moba import parallel_moba
    from tests.models.layers.test_fla_moba import naive_moba

    generator = torch.Generator("cuda").manual_seed(len(lengths))
    total = sum(lengths)
    cu_seqlens = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    q = torch.randn(1, total, 4, 64, device="cuda", generator=generator, requires_grad=True)
    k, v = (
        torch.randn(1, total, 2, 64, device="cuda", generator=generator, requires_grad=True) for _ in "kv"
    )
    out = parallel_moba(q, k, v, cu_seqlens, max(lengths), 64, 3)
    grad = torch.randn(out.shape, device="cuda", generator=generator)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    inputs = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    want = naive_moba(*inputs, cu_seqlens.cpu(), 64, 3)
    want_grads = torch.autograd.grad(want, inputs, grad.cpu().double())
    assert err_ratio(want, out.cpu()) < FP32_LIMIT
    for name, got, ref in zip("qkv", grads, want_grads):
        assert err_ratio(ref, got.cpu()) < FP32_LIMIT, name


@pytest.mark.parametrize("documents, length, chunk_size", [(2, 256, 128), (1, 384, 256)])
def test_compiled_parallel_moba_attends_by_flex_attention_as_the_pattern(
    documents, length, chunk_size, exact_float32
):
    """Compiled, flame's parallel_moba runs FlexAttention with MoBA's block mask (fla_moba.flex_serves) on rows of
    one length: float32 output and gradients against the pattern written out in float64 (blocks ending mid-row
    where the row is not a whole number of blocks)."""
    from flame.models.layers import fla_moba
    from tests.models.layers.test_fla_moba import naive_moba

    generator = torch.Generator("cuda").manual_seed(length)
    cu_seqlens = torch.arange(documents + 1, dtype=torch.int32, device="cuda") * length
    q = torch.randn(1, documents * length, 2, 32, device="cuda", generator=generator, requires_grad=True)
    k, v = (
        torch.randn(1, documents * length, 1, 32, device="cuda", generator=generator, requires_grad=True)
        for _ in "kv"
    )

    def attend(q, k, v):
        assert fla_moba.flex_serves(q.transpose(1, 2), chunk_size, length)  # traced: is_compiling() holds
        return fla_moba.parallel_moba(q, k, v, cu_seqlens, length, chunk_size, 3)

    torch._dynamo.reset()
    out = torch.compile(attend, fullgraph=True)(q, k, v)
    grad = torch.randn(out.shape, device="cuda", generator=generator)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    inputs = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    want = naive_moba(*inputs, cu_seqlens.cpu(), chunk_size, 3)
    want_grads = torch.autograd.grad(want, inputs, grad.cpu().double())
    assert err_ratio(want, out.cpu()) < FP32_LIMIT
    for name, got, ref in zip("qkv", grads, want_grads):
        assert err_ratio(ref, got.cpu()) < FP32_LIMIT, name
