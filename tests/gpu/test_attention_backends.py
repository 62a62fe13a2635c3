"""Every CUDA attention backend (flame.ops.attention.BACKENDS) on plain causal softmax attention against the
float64 reference, eager and inside a compiled graph.

Inputs are bf16 (cuDNN's and FlashAttention's dtype); the reference runs in float64 on exactly those values with
the same output gradient. Limits: the relative RMS error ||x - ref|| / ||ref||, o 5e-3 and dq/dk/dv 1e-2, as for
flame's softpick kernel in bf16 (test_softpick_kernel.py: o is stored in bf16, whose rounding alone costs ~1e-3).
The compiled graph (inductor, fullgraph) must give the eager values and run the backend's SDPA kernel (the aten op
the profiler records): a backend that pins its kernel with a context manager (flash, cudnn) must keep that choice
under torch.compile; auto may run either (torch 2.11 picks cuDNN on H100/H200).
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flame.ops.attention import BACKENDS, attention, reference_attention, set_attention_backend

DEVICE = "cuda"
LIMITS = {"o": 5e-3, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2}


def inputs(batch, seq_len, heads, kv_heads, head_dim, seed):
    generator = torch.Generator(DEVICE).manual_seed(seed)
    shapes = [(batch, seq_len, heads, head_dim)] + [(batch, seq_len, kv_heads, head_dim)] * 2
    return [torch.randn(s, device=DEVICE, generator=generator).bfloat16().requires_grad_() for s in shapes]


def relative_rms(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


@pytest.fixture
def backend(request):
    set_attention_backend(request.param)
    yield request.param
    set_attention_backend("auto")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"], indirect=True)
@pytest.mark.parametrize("shape", [(2, 999, 8, 8, 64), (1, 1537, 8, 2, 128)], ids=["mha_d64", "gqa_d128"])
def test_causal_softmax_matches_float64_reference(backend, shape):
    q, k, v = inputs(*shape, seed=11)
    out = attention(q, k, v, impl="softmax")
    do = torch.randn(out.shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(3)).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference_attention(q64, k64, v64, impl="softmax")
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    errors = {"o": relative_rms(out, ref)}
    errors.update({name: relative_rms(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    failed = {name: f"{e:.2e}" for name, e in errors.items() if not e <= LIMITS[name]}
    assert not failed, f"{backend}: over the limits {LIMITS}: {failed} (all: {errors})"


# Eager SDPA records aten::_scaled_dot_product_<kernel>_attention; a compiled graph calls the kernel's own op
# (aten::_cudnn_attention_forward, seen in the compiled transformer's profile): both names hold these parts.
SDPA_OPS = {
    "auto": ("flash_attention", "cudnn_attention"),
    "flash": ("flash_attention",),
    "cudnn": ("cudnn_attention",),
}


@pytest.mark.parametrize("backend", list(SDPA_OPS), indirect=True)
def test_compiled_graph_equals_eager_and_keeps_the_kernel(backend):
    q, k, v = inputs(2, 513, 4, 4, 64, seed=5)

    def loss(q, k, v):
        return attention(q * 2, k, v, impl="softmax").float().square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        fn(q, k, v)  # compile outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            value = fn(q, k, v)
        ops = {event.name for event in prof.events() if event.name.startswith("aten::")}
        kernels = {kernel for kernel in SDPA_OPS[backend] if any(kernel in op for op in ops)}
        assert kernels, f"{backend}: no op of {SDPA_OPS[backend]} among {sorted(ops)}"
        results.append((value, *torch.autograd.grad(value, (q, k, v))))
    torch.testing.assert_close(results[1], results[0], rtol=1e-3, atol=1e-3)
