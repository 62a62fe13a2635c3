"""flame/ops/gated_delta_rule/flash_qla.py without a GPU: which CUDA calls of `chunk_gated_delta_rule` FlashQLA
serves (CPU tensors that claim is_cuda, FlashQLA's package replaced by a recorder with its signature), and what it
receives: the gate and beta computed before the call exactly as flame's PyTorch path computes them. Its numbers
against the PyTorch reference are tests/gpu/test_flash_qla.py's."""

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from flame.ops import chunk_gated_delta_rule, dispatch, fla_library
from flame.ops.gated_delta_rule import GATED_DELTA_RULE, flash_qla, gdn_gate
from tests.ops.test_dispatch import PretendCuda

SENTINEL = object()


def flash_qla_signature(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False, state_v_first=False,
                        auto_cp=True, enable_fwd_cp_cache=True, cp_context=None, force_intra_cp=False):  # fmt: skip
    """flash-qla 0.1.3's `chunk_gated_delta_rule` signature."""


@pytest.fixture
def installed(monkeypatch):
    """FlashQLA 'installed' on an SM90 GPU: its package is a recorder, FLA's op must not run. Yields the calls."""
    calls = []
    signature = inspect.signature(flash_qla_signature)

    def recorder(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs).arguments)
        return SENTINEL

    monkeypatch.setitem(sys.modules, "flash_qla", types.SimpleNamespace(chunk_gated_delta_rule=recorder))
    monkeypatch.setattr(GATED_DELTA_RULE, "missing", {})
    monkeypatch.setattr(flash_qla, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(flash_qla, "nvcc_found", lambda: True)
    return calls


def inputs(head_dim=128, value_dim=128, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 13, 2, head_dim, generator=generator, dtype=dtype) for _ in range(2))
    v = torch.randn(1, 13, 4, value_dim, generator=generator, dtype=dtype)
    a, b = (torch.randn(1, 13, 4, generator=generator, dtype=dtype) for _ in range(2))
    return [x.as_subclass(PretendCuda) for x in (q, k, v, a, b)]


def layer_call(q, k, v, a, b, **flags):
    """The call flame's Gated DeltaNet layer makes: gate and beta sigmoid in the kernel, value-first states."""
    A_log, dt_bias = torch.linspace(0.1, 2.0, 4), torch.linspace(-1.0, 1.0, 4)
    cu_seqlens = torch.tensor([0, 6, 13])
    options = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                   use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens)  # fmt: skip
    return chunk_gated_delta_rule(q, k, v, a, b, **{**options, **flags}), (A_log, dt_bias, cu_seqlens)


def test_flash_qla_gets_the_gate_and_beta_computed_before_the_call(installed, monkeypatch):
    import fla.ops.gated_delta_rule

    monkeypatch.setattr(
        fla.ops.gated_delta_rule, "chunk_gated_delta_rule", lambda *a, **k: pytest.fail("FLA ran")
    )
    q, k, v, a, b = inputs()
    result, (A_log, dt_bias, cu_seqlens) = layer_call(q, k, v, a, b)
    assert result is SENTINEL
    (call,) = installed
    expected_g = gdn_gate(a.as_subclass(torch.Tensor), A_log, dt_bias)
    torch.testing.assert_close(call["g"].as_subclass(torch.Tensor), expected_g, rtol=0, atol=0)
    assert call["g"].dtype == torch.float32
    expected_beta = torch.sigmoid(b.as_subclass(torch.Tensor).float()).bfloat16()
    torch.testing.assert_close(call["beta"].as_subclass(torch.Tensor), expected_beta, rtol=0, atol=0)
    assert call["q"] is q and call["k"] is k and call["v"] is v and call["cu_seqlens"] is cu_seqlens
    assert call["use_qk_l2norm_in_kernel"] and call["state_v_first"] and call["auto_cp"]


@pytest.mark.parametrize(
    "case, reason",
    [
        ({"head_dim": 256, "value_dim": 512}, "takes K = V = 128 only, not K = 256, V = 512"),
        ({"dtype": torch.float32}, "takes bfloat16 or float16 q, k and v of one dtype"),
        ({"allow_neg_eigval": True}, "has no negative eigenvalues (allow_neg_eigval)"),
        ({"capability": (8, 0)}, "runs on SM90, SM100 and SM103 GPUs only"),
        ({"capability": (12, 0)}, "runs on SM90, SM100 and SM103 GPUs only"),
        ({"nvcc": False}, "needs nvcc (on PATH or under CUDA_HOME) to compile its TileLang kernels"),
    ],
)
def test_calls_flash_qla_refuses_go_to_fla_with_one_log_line(installed, monkeypatch, caplog, case, reason):
    import fla.ops.gated_delta_rule

    fla_calls = []
    monkeypatch.setattr(
        fla.ops.gated_delta_rule, "chunk_gated_delta_rule", lambda *a, **k: fla_calls.append(k) or SENTINEL
    )
    case = dict(case)
    capability, nvcc = case.pop("capability", (9, 0)), case.pop("nvcc", True)
    monkeypatch.setattr(flash_qla, "device_capability", lambda device: capability)
    monkeypatch.setattr(flash_qla, "nvcc_found", lambda: nvcc)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(dispatch, "_PASSED_OVER", set())
    flags = {"allow_neg_eigval": case.pop("allow_neg_eigval")} if "allow_neg_eigval" in case else {}
    with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
        result, _ = layer_call(*inputs(**case), **flags)
    assert result is SENTINEL and installed == [] and len(fla_calls) == 1
    assert fla_calls[0]["use_gate_in_kernel"]  # FLA keeps the fused gate
    assert caplog.messages == [
        f"chunk_gated_delta_rule: the flash_qla backend {reason}; the fla implementation serves it"
    ]


def test_a_compiled_call_flash_qla_refuses_stays_one_graph(installed, monkeypatch, caplog):
    """A compiled Gated DeltaNet block whose heads FlashQLA refuses (the 340M model's K = 256, V = 512) traces the
    refusal (without asking the device, which the call's shapes settle first) and reaches FLA's custom ops without
    a graph break; the step logs the refusal once."""
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(dispatch, "_PASSED_OVER", set())
    monkeypatch.setattr(flash_qla, "device_capability", lambda device: pytest.fail("the shapes decide first"))
    monkeypatch.setattr(
        fla_library, "chunk_gated_delta_rule", lambda q, k, v, g, beta, **kwargs: (v * 2, None)
    )
    compiled = torch.compile(lambda *x: layer_call(*x)[0][0] + 1, fullgraph=True, backend="eager")
    q, k, v, a, b = inputs(head_dim=256, value_dim=512)
    with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
        for _ in range(2):
            torch.testing.assert_close(compiled(q, k, v, a, b), v * 2 + 1, rtol=0, atol=0)
        dispatch.log_passed_over_calls()
    assert installed == [] and caplog.messages == [
        "chunk_gated_delta_rule: the flash_qla backend takes K = V = 128 only, not K = 256, V = 512; the fla "
        "implementation serves it"
    ]


def test_without_flash_qla_installed_fla_serves_without_a_word(monkeypatch, caplog):
    """Where flash-qla and tilelang are not installed (CI, the default GPU stack) FLA serves the call and nothing is
    logged: an optional package left out is no news."""
    import fla.ops.gated_delta_rule

    monkeypatch.setattr(GATED_DELTA_RULE, "missing", {"flash_qla": ("flash_qla", "tilelang")})
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(dispatch, "_PASSED_OVER", set())
    monkeypatch.setattr(fla.ops.gated_delta_rule, "chunk_gated_delta_rule", lambda *a, **k: SENTINEL)
    with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
        assert layer_call(*inputs())[0] is SENTINEL
    assert caplog.messages == []


def test_the_precomputed_gate_and_beta_give_the_fused_calls_result():
    """What flash_qla.py hands over (g from gdn_gate, sigmoid(beta)) is what the fused flags compute: on the PyTorch
    path both calls agree exactly (float64)."""
    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 29, 2, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 29, 4, 24, generator=generator, dtype=torch.float64)
    a, b = (torch.randn(1, 29, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    A_log, dt_bias = torch.rand(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    fused, _ = chunk_gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                      use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)  # fmt: skip
    outside, _ = chunk_gated_delta_rule(
        q, k, v, gdn_gate(a, A_log, dt_bias), F.sigmoid(b), use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(outside, fused, rtol=0, atol=0)


# FlashQLA 0.1.3's internal functions that the custom ops call (flash_qla.ops.gated_delta_rule.chunk, flash_qla.utils).
def fwd_signature(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, output_final_state=True,
                  output_h=False, auto_cp=True, state_v_first=False, enable_fwd_cp_cache=False, cp_context=None,
                  is_train=None):  # fmt: skip
    """Returns (g cumsum, A, o, h, final state, CP cache)."""


def bwd_signature(q, k, v, g, beta, A, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                  state_v_first=False, auto_cp=True, cp_cache=None, cp_context=None):  # fmt: skip
    """Returns (dq, dk, dv, dbeta, dg, dh0)."""


def l2norm_fwd_signature(x, eps=1e-6, dim=-1):
    """Returns (y, rstd [..., without the last dim], float32)."""


def l2norm_bwd_signature(y, rstd, dy, eps=1e-6, dim=-1):
    """Returns dx."""


@pytest.fixture
def internals(monkeypatch):
    """FlashQLA's internal functions replaced by recorders bound to their 0.1.3 signatures, returning CPU tensors
    of the shapes and dtypes its source returns (its kernels need a Hopper GPU: tests/gpu/test_flash_qla.py)."""
    calls = []

    def recorder(name, signature, result):
        def record(*args, **kwargs):
            arguments = inspect.signature(signature).bind(*args, **kwargs)
            arguments.apply_defaults()
            calls.append((name, dict(arguments.arguments)))
            return result(arguments.arguments)

        return record

    def fwd(a):
        batch, seq_len, heads, value_dim = a["v"].shape
        states = batch if a["cu_seqlens"] is None else len(a["cu_seqlens"]) - 1
        key_dim = a["k"].shape[-1]
        layout = (value_dim, key_dim) if a["state_v_first"] else (key_dim, value_dim)
        final = torch.randn(states, heads, *layout) if a["output_final_state"] else None
        return (torch.randn_like(a["g"]), torch.randn(batch, seq_len, heads, 64, dtype=a["k"].dtype),
                torch.randn_like(a["v"]), None, final, None)  # fmt: skip

    def bwd(a):
        h0 = a["initial_state"]
        return (*(torch.randn_like(a[name]) for name in ("q", "k", "v", "beta")),
                torch.randn_like(a["g"], dtype=torch.float32), None if h0 is None else torch.randn_like(h0))  # fmt: skip

    chunk = types.SimpleNamespace(
        chunk_gated_delta_rule_fwd=recorder("fwd", fwd_signature, fwd),
        chunk_gated_delta_rule_bwd=recorder("bwd", bwd_signature, bwd),
    )
    utils = types.SimpleNamespace(
        l2norm_fwd=recorder("l2norm_fwd", l2norm_fwd_signature,
                            lambda a: (torch.randn_like(a["x"]), torch.rand(a["x"].shape[:-1]))),
        l2norm_bwd=recorder("l2norm_bwd", l2norm_bwd_signature, lambda a: torch.randn_like(a["dy"])),
    )  # fmt: skip
    for name, module in (("flash_qla", types.SimpleNamespace()), ("flash_qla.ops", types.SimpleNamespace()),
                         ("flash_qla.ops.gated_delta_rule", types.SimpleNamespace()),
                         ("flash_qla.ops.gated_delta_rule.chunk", chunk), ("flash_qla.utils", utils)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def op_inputs(lengths=(5, 8), state=True, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(2)
    varlen = len(lengths) > 1
    batch, seq_len = (1, sum(lengths)) if varlen else (2, lengths[0])
    q, k = (torch.randn(batch, seq_len, 2, 8, generator=generator, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, seq_len, 4, 6, generator=generator, dtype=dtype)
    g = torch.randn(batch, seq_len, 4, generator=generator)  # the log decay, float32 as gdn_gate gives it
    beta = torch.rand(batch, seq_len, 4, generator=generator, dtype=dtype)
    h0 = torch.randn(len(lengths) if varlen else batch, 4, 6, 8, generator=generator) if state else None
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if varlen else None
    return q, k, v, g, beta, h0, cu_seqlens


def described(tensors) -> list[tuple]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


FLAG_CASES = [
    dict(lengths=(5, 8), state=True, output_final_state=True, l2norm=True, state_v_first=True),
    dict(lengths=(7,), state=False, output_final_state=False, l2norm=False, state_v_first=False),
]


@pytest.mark.parametrize("case", FLAG_CASES)
def test_the_custom_ops_call_flash_qla_as_its_function_does_and_their_fakes_agree(internals, case):
    q, k, v, g, beta, h0, cu_seqlens = op_inputs(case["lengths"], case["state"])
    flags = (0.3, case["output_final_state"], case["l2norm"], case["state_v_first"])
    forward = flash_qla.gated_delta_rule_fwd
    outputs = forward._init_fn(q, k, v, g, beta, h0, cu_seqlens, *flags)
    assert described(outputs) == described(forward._abstract_fn(q, k, v, g, beta, h0, cu_seqlens, *flags))
    (name, call), *normed = reversed(internals)
    assert name == "fwd" and [n for n, _ in normed] == ["l2norm_fwd"] * 2 * case["l2norm"]
    assert (
        call["output_h"] is False and call["auto_cp"] and call["is_train"] and not call["enable_fwd_cp_cache"]
    )
    assert call["scale"] == 0.3 and call["state_v_first"] == case["state_v_first"]
    assert call["initial_state"] is h0 and call["cu_seqlens"] is cu_seqlens and call["g"] is g
    if case[
        "l2norm"
    ]:  # the kernels get the normalised q and k, which the forward also returns for the backward
        assert call["q"] is outputs[2] and call["k"] is outputs[4]
    else:
        assert call["q"] is q and call["k"] is k and outputs[2].numel() == outputs[3].numel() == 0

    internals.clear()
    do, dht = torch.randn_like(v), torch.randn_like(outputs[1]) if case["output_final_state"] else None
    saved = (outputs[2], outputs[3], outputs[4], outputs[5]) if case["l2norm"] else (q, None, k, None)
    arguments = (do, dht, *saved, v, outputs[6], beta, outputs[7], h0, cu_seqlens, 0.3, case["state_v_first"])
    backward = flash_qla.gated_delta_rule_bwd
    gradients = backward._init_fn(*arguments)
    assert described(gradients) == described(backward._abstract_fn(*arguments))
    assert described(gradients[:5]) == described((q, k, v, g, beta))
    (name, call), *normed = internals
    assert name == "bwd" and [n for n, _ in normed] == ["l2norm_bwd"] * 2 * case["l2norm"]
    assert call["g"] is outputs[6] and call["A"] is outputs[7] and call["beta"] is beta and call["dht"] is dht
    assert call["auto_cp"] and call["cp_cache"] is None and call["cp_context"] is None


def test_a_compiled_refusal_check_of_a_call_flash_qla_takes_traces_whole(monkeypatch):
    """Where FlashQLA takes the call's shapes (K = V = 128, bf16) the refusal check asks the device and looks for
    nvcc: both are constants to dynamo, so a compiled block stays one graph (fullgraph=True fails on a break) and
    decides as the eager call does."""
    q, k, v, a, b = inputs()
    compiled = torch.compile(
        lambda *x: (x[0] * 2, flash_qla.flash_qla_refuses(*x)), fullgraph=True, backend="eager"
    )
    for major in (9, 8):
        properties = types.SimpleNamespace(major=major, minor=0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, p=properties: p)
        torch._dynamo.reset()
        assert compiled(q, k, v, a, b)[1] == flash_qla.flash_qla_refuses(q, k, v, a, b)
