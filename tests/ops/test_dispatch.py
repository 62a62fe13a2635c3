"""The dispatchers' CUDA branches, driven without a GPU: a CPU tensor that claims is_cuda=True walks each branch down
to FLA's public function, which is replaced by a recorder that binds the call to the real function's signature.
This checks that CUDA tensors reach FLA, with argument names FLA 0.6.0 accepts (and, for the ones FLA reads from
**kwargs, names its source reads). That CPU tensors never reach FLA is checked by every other test: FLA's kernels
raise on CPU tensors ("0 active drivers").

Under torch.compile (``torch.compiler.is_compiling()`` patched to True here) the gated and the plain chunk delta rule
reach flame's custom-op wrappers in flame.ops.fla_library instead (test_fla_library.py checks its calls into FLA), and the norms
the PyTorch code. The short convolution is flame's own Triton kernel (a custom op) in both modes."""

import inspect
import typing

import fla.modules.norm.fused_norm_gate
import fla.modules.norm.layernorm
import fla.ops.attn
import fla.ops.delta_rule
import fla.ops.gated_delta_rule
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant

from flame.config.job_config import Model
from flame.ops import (
    attention,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    fla_library,
    fused_recurrent_delta_rule,
    gated_rms_norm,
    rms_norm,
    short_conv,
)
from flame.ops.attention import ATTENTION_BACKENDS, reference_attention, set_attention_backend


class PretendCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda=True."""

    @property
    def is_cuda(self):
        return True


def tensor(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).as_subclass(PretendCuda)


SENTINEL = object()
cu_seqlens = torch.tensor([0, 5, 8], dtype=torch.int32)

# (FLA module, name of its public function, what the function returns, the flame call, arguments FLA must receive)
CASES = {
    "chunk_gated_delta_rule": (
        fla.ops.gated_delta_rule,
        "chunk_gated_delta_rule",
        SENTINEL,
        lambda: chunk_gated_delta_rule(
            tensor(1, 8, 2, 4),
            tensor(1, 8, 2, 4),
            tensor(1, 8, 4, 4),
            tensor(1, 8, 4),
            tensor(1, 8, 4),
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            state_v_first=True,
            cu_seqlens=cu_seqlens,
            use_gate_in_kernel=True,
            A_log=torch.zeros(4),
            dt_bias=torch.zeros(4),
            chunk_size=32,
        ),
        {"state_v_first": True, "use_gate_in_kernel": True, "chunk_size": 32, "cu_seqlens": cu_seqlens},
    ),
    "chunk_delta_rule": (
        fla.ops.delta_rule,
        "chunk_delta_rule",
        SENTINEL,
        lambda: chunk_delta_rule(
            *(tensor(*shape, dtype=torch.bfloat16) for shape in [(1, 8, 2, 4)] * 3 + [(1, 8, 2)]),
            chunk_size=16,
        ),  # FLA's chunk kernel takes half precision only (test_dispatch_table.py: float32 runs the PyTorch code)
        {"chunk_size": 16},
    ),
    "fused_recurrent_delta_rule": (
        fla.ops.delta_rule,
        "fused_recurrent_delta_rule",
        SENTINEL,
        lambda: fused_recurrent_delta_rule(
            tensor(1, 8, 2, 4), tensor(1, 8, 2, 4), tensor(1, 8, 2, 4), use_qk_l2norm_in_kernel=True
        ),
        {"use_qk_l2norm_in_kernel": True},
    ),
    "rms_norm": (
        fla.modules.norm.layernorm,
        "rms_norm",
        SENTINEL,
        lambda: rms_norm(tensor(3, 6), torch.ones(6), eps=1e-6),
        {"eps": 1e-6},
    ),
    "gated_rms_norm": (
        fla.modules.norm.fused_norm_gate,
        "rms_norm_gated",
        SENTINEL,
        lambda: gated_rms_norm(tensor(3, 6), tensor(3, 6), torch.ones(6), eps=1e-6, activation="sigmoid"),
        {"eps": 1e-6, "activation": "sigmoid"},
    ),
    "attention": (
        fla.ops.attn,
        "parallel_attn",
        SENTINEL,
        lambda: attention(
            tensor(1, 8, 4, 4),
            tensor(1, 8, 2, 4),
            tensor(1, 8, 2, 4),
            impl="softmax",
            window_size=3,
            scale=0.5,
        ),
        {"window_size": 3, "scale": 0.5},
    ),
}


def check_call_reaches(module, name, returns, call, expected_arguments, monkeypatch) -> None:
    """Replace module.name by a recorder bound to its signature, make the call, check the recorded arguments (a
    value, or a check on the value)."""
    function = getattr(module, name)
    signature = inspect.signature(function)
    calls = []

    def recorder(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        calls.append(bound.arguments)
        return returns

    monkeypatch.setattr(module, name, recorder)
    result = call()
    assert result is SENTINEL
    (arguments,) = calls
    extra_keywords = arguments.pop("kwargs", {})
    source = inspect.getsource(function)
    for keyword in extra_keywords:
        assert f"'{keyword}'" in source, f"{name} never reads **kwargs[{keyword!r}]"
    arguments.update(extra_keywords)
    for key, value in expected_arguments.items():
        if callable(value):
            assert value(arguments[key]), key
        else:
            assert arguments[key] is value or arguments[key] == value, key


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_tensors_reach_fla_with_arguments_it_accepts(case, monkeypatch):
    check_call_reaches(*CASES[case], monkeypatch)


# Under torch.compile: (module, function, what it returns, the flame call, arguments it must receive).
COMPILED_CASES = {
    "chunk_gated_delta_rule": (
        fla_library,
        "chunk_gated_delta_rule",
        SENTINEL,
        *CASES["chunk_gated_delta_rule"][3:],
    ),
    "chunk_delta_rule": (fla_library, "chunk_delta_rule", SENTINEL, *CASES["chunk_delta_rule"][3:]),
}


@pytest.mark.parametrize("case", list(COMPILED_CASES))
def test_under_compile_cuda_tensors_reach_the_custom_op_wrappers(case, monkeypatch):
    fla_module, fla_name = CASES[case][:2]
    monkeypatch.setattr(fla_module, fla_name, lambda *a, **k: pytest.fail(f"FLA's {fla_name} must not run"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    check_call_reaches(*COMPILED_CASES[case], monkeypatch)


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compiled"])
def test_cuda_short_conv_runs_flames_triton_kernel(compiling, monkeypatch):
    from flame.ops.short_conv import triton_kernel

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    weight = torch.randn(6, 1, 4)
    x = tensor(1, 8, 6)
    check_call_reaches(
        triton_kernel,
        "short_conv_group_triton",
        [SENTINEL],
        lambda: short_conv(x, weight, activation="silu", cu_seqlens=cu_seqlens),
        dict(
            members=lambda members: (
                len(members) == 1 and all(a is b for a, b in zip(members[0], (x, weight, None)))
            ),
            activation="silu",
            cu_seqlens=cu_seqlens,
        ),
        monkeypatch,
    )


def test_under_compile_fla_context_parallelism_stays_on_flas_op(monkeypatch):
    monkeypatch.setattr(
        fla_library, "chunk_gated_delta_rule", lambda *a, **k: pytest.fail("no custom ops for CP")
    )
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    context = object()
    fla_module, fla_name, returns, _, _ = CASES["chunk_gated_delta_rule"]

    def call():
        q, k = tensor(1, 8, 2, 4), tensor(1, 8, 2, 4)
        return chunk_gated_delta_rule(
            q, k, tensor(1, 8, 2, 4), tensor(1, 8, 2), tensor(1, 8, 2), cp_context=context
        )

    check_call_reaches(fla_module, fla_name, returns, call, {"cp_context": context}, monkeypatch)


@pytest.mark.parametrize("case", ["rms_norm", "gated_rms_norm"])
def test_under_compile_norms_run_the_pytorch_code(case, monkeypatch):
    fla_module, fla_name, _, call, _ = CASES[case]
    monkeypatch.setattr(fla_module, fla_name, lambda *a, **k: pytest.fail(f"FLA's {fla_name} must not run"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.isfinite(call()).all()


@pytest.mark.parametrize("impl", ["softpick", "rectified"])
def test_softpick_family_goes_to_flames_kernel(impl, monkeypatch):
    from flame.ops.attention import softpick_triton

    def fail(*args, **kwargs):
        raise AssertionError("softpick/rectified must not be sent to FLA's softmax kernel")

    calls = []

    def kernel(q, k, v, **kwargs):
        calls.append(kwargs)
        return SENTINEL

    monkeypatch.setattr(fla.ops.attn, "parallel_attn", fail)
    monkeypatch.setattr(softpick_triton, "softpick_attention", kernel)
    q, k, v = (tensor(1, 8, 2, 4) for _ in range(3))
    assert attention(q, k, v, impl=impl, window_size=3, cu_seqlens=cu_seqlens) is SENTINEL
    assert calls == [{"variant": impl, "window_size": 3, "cu_seqlens": cu_seqlens, "scale": None}]


@pytest.fixture
def attention_backend():
    """Sets the attention backend for one test and restores the default afterwards."""
    yield set_attention_backend
    set_attention_backend("auto")


def test_fla_backend_sends_plain_causal_softmax_to_fla(attention_backend, monkeypatch):
    calls = []
    monkeypatch.setattr(
        fla.ops.attn, "parallel_attn", lambda q, k, v, **kwargs: calls.append(kwargs) or SENTINEL
    )
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("SDPA must not run"))
    q, k, v = (tensor(2, 8, 2, 4) for _ in range(3))
    attention_backend("fla")
    assert attention(q, k, v, impl="softmax") is SENTINEL
    assert calls == [{"scale": None, "window_size": None, "cu_seqlens": None}]


@pytest.mark.parametrize("query_len", [8, 3])
@pytest.mark.parametrize("impl", ["softmax", "softpick", "rectified"])
def test_reference_backend_runs_the_pytorch_attention_on_cuda(
    attention_backend, impl, query_len, monkeypatch
):
    from flame.ops.attention import softpick_triton

    def fail(*args, **kwargs):
        raise AssertionError("no GPU kernel may run under the reference backend")

    monkeypatch.setattr(fla.ops.attn, "parallel_attn", fail)
    monkeypatch.setattr(softpick_triton, "softpick_attention", fail)
    q, k, v = (torch.randn(1, 8, 2, 4) for _ in range(3))
    q = q[:, -query_len:]
    attention_backend("reference")
    actual = attention(*(x.as_subclass(PretendCuda) for x in (q, k, v)), impl=impl, window_size=3)
    expected = reference_attention(q, k, v, impl=impl, window_size=3)
    torch.testing.assert_close(actual.as_subclass(torch.Tensor), expected, rtol=0, atol=0)


def fail_fla(*args, **kwargs):
    raise AssertionError("FLA's parallel_attn must not get fewer queries than keys")


@pytest.mark.parametrize("backend", ["auto", "fla"])
def test_fewer_queries_softmax_runs_sdpa_with_a_lower_right_causal_bias(
    attention_backend, backend, monkeypatch
):
    """SDPA gets causal_lower_right(Tq, Tk) (its is_causal would align the queries to the start of the keys); the
    bias then runs on the CPU here, and the output equals the reference's (float64, rtol = atol = 1e-12)."""
    sdpa = F.scaled_dot_product_attention
    calls = []

    def recorder(*args, **kwargs):
        calls.append(kwargs)
        # The bias' __torch_function__ only handles the call when F.scaled_dot_product_attention is the real one.
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        return sdpa(*(x.as_subclass(torch.Tensor) for x in args), **kwargs)

    monkeypatch.setattr(fla.ops.attn, "parallel_attn", fail_fla)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recorder)
    q = torch.randn(1, 5, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 12, 2, 8, dtype=torch.float64) for _ in range(2))
    attention_backend(backend)
    actual = attention(*(x.as_subclass(PretendCuda) for x in (q, k, v)), impl="softmax", scale=0.5)

    (kwargs,) = calls
    bias = kwargs["attn_mask"]
    assert isinstance(bias, CausalBias) and bias.variant == CausalVariant.LOWER_RIGHT
    assert (bias.seq_len_q, bias.seq_len_kv) == (5, 12)
    assert kwargs["enable_gqa"] and kwargs["scale"] == 0.5 and not kwargs.get("is_causal", False)
    expected = reference_attention(q, k, v, impl="softmax", scale=0.5)
    torch.testing.assert_close(actual.as_subclass(torch.Tensor), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["auto", "fla"])
def test_fewer_queries_windowed_softmax_runs_the_reference(attention_backend, backend, monkeypatch):
    monkeypatch.setattr(fla.ops.attn, "parallel_attn", fail_fla)
    q, k, v = (torch.randn(1, 12, 2, 4) for _ in range(3))
    q = q[:, -5:]
    attention_backend(backend)
    actual = attention(*(x.as_subclass(PretendCuda) for x in (q, k, v)), impl="softmax", window_size=3)
    expected = reference_attention(q, k, v, impl="softmax", window_size=3)
    torch.testing.assert_close(actual.as_subclass(torch.Tensor), expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["auto", "fla"])
@pytest.mark.parametrize("impl", ["softpick", "rectified"])
def test_fewer_queries_softpick_family_goes_to_flames_kernel(attention_backend, backend, impl, monkeypatch):
    from flame.ops.attention import softpick_triton

    calls = []

    def kernel(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], kwargs))
        return SENTINEL

    monkeypatch.setattr(fla.ops.attn, "parallel_attn", fail_fla)
    monkeypatch.setattr(softpick_triton, "softpick_attention", kernel)
    q, k, v = tensor(1, 5, 2, 4), tensor(1, 12, 2, 4), tensor(1, 12, 2, 4)
    attention_backend(backend)
    assert attention(q, k, v, impl=impl, window_size=3) is SENTINEL
    assert calls == [(5, 12, {"variant": impl, "window_size": 3, "cu_seqlens": None, "scale": None})]


@pytest.mark.parametrize("impl", ["softmax", "softpick", "rectified"])
def test_fewer_queries_with_cu_seqlens_are_refused_on_cuda(impl, monkeypatch):
    monkeypatch.setattr(fla.ops.attn, "parallel_attn", fail_fla)
    q, k, v = tensor(1, 3, 2, 4), tensor(1, 8, 2, 4), tensor(1, 8, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens needs as many queries as keys"):
        attention(q, k, v, impl=impl, cu_seqlens=cu_seqlens)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention backend must be one of"):
        set_attention_backend("flash_3")


def test_the_configs_attention_backends_are_the_ops():
    # The job config lists the choices (its parser refuses others before any op is imported); the op serves each.
    choices = typing.get_args(typing.get_type_hints(Model)["attention_backend"])
    assert choices == ATTENTION_BACKENDS
