"""The bodies of flame.ops.fla_library's custom ops on CPU, with FLA's internal functions replaced by recorders.

The custom ops call FLA 0.6.0's internal functions (chunk_gated_delta_rule_fwd / _bwd, l2norm_fwd / _bwd,
fused_beta_sigmoid_fwd / _bwd, prepare_chunk_indices), not its public API, so a new FLA
release may rename their arguments or change what they return. Their Triton kernels need a GPU
(tests/gpu/test_fla_library.py runs them); here each recorder binds its call to the real function's signature (an
argument name FLA does not accept raises TypeError) and returns CPU tensors of the shapes and dtypes FLA's source
returns, so API drift and wiring mistakes show on CPU CI. The fake (shape-only) implementations are compared with
what the bodies return.
"""

import inspect
from types import SimpleNamespace

import fla.modules.norm.l2norm
import fla.ops.common.gate
import fla.ops.delta_rule.chunk
import fla.ops.gated_delta_rule.chunk
import fla.ops.utils.index
import pytest
import torch

import flame.ops.gated_delta_rule.dqkwg_reference
from flame.ops import fla_library

B, T, H, HV, K, V, CHUNK = 2, 8, 2, 4, 4, 3, 32  # K != V: a transposed state layout shows in the shapes
# torch's CustomOpDef keeps the decorated function as _init_fn and the register_fake one as _abstract_fn.
GDN_FWD, GDN_BWD = fla_library.gated_delta_rule_fwd, fla_library.gated_delta_rule_bwd
DELTA_FWD, DELTA_BWD = fla_library.delta_rule_fwd, fla_library.delta_rule_bwd


def f32(*shape):
    return torch.empty(*shape, dtype=torch.float32)


def gdn_fwd(a):  # (g cumsum, o, A, final state, initial state, g_input)
    batch = a["v"].shape[0]
    states = batch if a["cu_seqlens"] is None else len(a["cu_seqlens"]) - 1
    state = f32(states, HV, *((V, K) if a["state_v_first"] else (K, V))) if a["output_final_state"] else None
    return (f32(batch, T, HV), torch.empty_like(a["v"]), a["k"].new_empty(batch, T, HV, a["chunk_size"]), state,
            a["initial_state"], a["g"] if a["use_gate_in_kernel"] else None)  # fmt: skip


def gdn_bwd(a):  # (dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias); dq, dk, dv, dbeta like q, k, v, beta
    gate, h0 = a["use_gate_in_kernel"], a["initial_state"]
    return (*(torch.empty_like(a[name]) for name in ("q", "k", "v", "beta")), f32(*a["g"].shape),
            None if h0 is None else f32(*h0.shape), f32(HV) if gate else None,
            f32(HV) if gate and a["dt_bias"] is not None else None)  # fmt: skip


def delta_fwd(a):  # (o, A, final state)
    batch = a["v"].shape[0]
    states = batch if a["cu_seqlens"] is None else len(a["cu_seqlens"]) - 1
    return (torch.empty_like(a["v"]), a["k"].new_empty(batch, T, H, a["chunk_size"]),
            f32(states, H, K, V) if a["output_final_state"] else None)  # fmt: skip


def delta_bwd(a):  # (dq, dk, dv, dbeta, dh0); dq, dk, dv, dbeta like q, k, v, beta; dh0 float32
    h0 = a["initial_state"]
    return (
        *(torch.empty_like(a[name]) for name in ("q", "k", "v", "beta")),
        None if h0 is None else f32(*h0.shape),
    )


# (module, name) of each FLA function the ops call: what it returns (per FLA's source), given its bound arguments
INTERNALS = {
    (fla.modules.norm.l2norm, "l2norm_fwd"): lambda a: (torch.empty_like(a["x"]), f32(*a["x"].shape[:-1])),
    (fla.modules.norm.l2norm, "l2norm_bwd"): lambda a: torch.empty_like(a["y"]),
    (fla.ops.common.gate, "fused_beta_sigmoid_fwd"): lambda a: torch.empty_like(a["x"], dtype=torch.float32),
    (fla.ops.common.gate, "fused_beta_sigmoid_bwd"): lambda a: torch.empty_like(a["x"]),
    (fla.ops.utils.index, "prepare_chunk_indices"): lambda a: torch.zeros(2, 2, dtype=torch.long),
    (fla.ops.gated_delta_rule.chunk, "chunk_gated_delta_rule_fwd"): gdn_fwd,
    (fla.ops.gated_delta_rule.chunk, "chunk_gated_delta_rule_bwd"): gdn_bwd,
    (flame.ops.gated_delta_rule.dqkwg_triton, "serve_where_fla_refuses"): lambda a: None,
    (fla.ops.delta_rule.chunk, "chunk_delta_rule_fwd"): delta_fwd,
    (fla.ops.delta_rule.chunk, "chunk_delta_rule_bwd"): delta_bwd,
}


def recorder(real, result, calls):
    """Binds each call to real's signature (which follows decorators' __wrapped__), records it, returns result."""
    signature = inspect.signature(real)

    def record(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append((bound.arguments, result(bound.arguments)))
        return calls[-1][1]

    return record


@pytest.fixture
def fla_calls(monkeypatch):
    """Replaces FLA's internals by recorders; returns {name: [(bound arguments, result), ...]}."""
    calls = {name: [] for _, name in INTERNALS}
    for (module, name), result in INTERNALS.items():
        monkeypatch.setattr(module, name, recorder(getattr(module, name), result, calls[name]))
    return calls


def same(actual, expected):
    """The same tensors (and None), equal other values."""
    return len(actual) == len(expected) and all(
        x is y if y is None or isinstance(y, torch.Tensor) else x == y for x, y in zip(actual, expected)
    )


def check_like(actual, expected):
    assert [(x.shape, x.dtype) for x in actual] == [(x.shape, x.dtype) for x in expected]


def gdn_arguments(layer: bool):
    """bf16 inputs (as under FSDP's mixed precision) with the flags of flame's GatedDeltaNet layer on packed
    documents and a state in and out, or with none of them (a batch, no state)."""
    dtype = torch.bfloat16
    batch, cu_seqlens = (1, torch.tensor([0, 5, 8])) if layer else (B, None)
    q, k, v = (torch.randn(batch, T, heads, dim, dtype=dtype) for heads, dim in ((H, K), (H, K), (HV, V)))
    g, beta = (torch.randn(batch, T, HV, dtype=dtype) for _ in range(2))
    flags = ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
             "use_gate_in_kernel", "output_final_state")  # fmt: skip
    return dict(
        q=q, k=k, v=v, g=g, beta=beta, A_log=torch.randn(HV, dtype=dtype) if layer else None,
        dt_bias=torch.randn(HV, dtype=dtype) if layer else None,
        initial_state=torch.randn(2, HV, V, K, dtype=dtype) if layer else None,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens.clone() if layer else None, scale=0.5, chunk_size=CHUNK,
        **dict.fromkeys(flags, layer),
    )  # fmt: skip


def forward_backward(forward_op, backward_op, backward_name, setup_context, backward, a, monkeypatch):
    """The forward op's body, then autograd's setup_context and backward with the backward op's body for the op.
    Returns (forward outputs, backward op arguments, backward op outputs, gradients for the forward's inputs)."""
    outputs, calls = forward_op._init_fn(**a), []

    def recorded_backward_op(*args):
        calls.append((args, backward_op._init_fn(*args)))
        return calls[-1][1]

    monkeypatch.setattr(fla_library, backward_name, recorded_backward_op)
    ctx = SimpleNamespace(mark_non_differentiable=lambda *_: None)
    ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
    inputs = tuple(a[name] for name in inspect.signature(forward_op._init_fn).parameters)
    setup_context(ctx, inputs, outputs)
    do, dht = torch.randn_like(outputs[0]), torch.randn_like(outputs[1])
    grads = backward(ctx, do, dht, *([None] * (len(outputs) - 2)))
    ((backward_arguments, backward_outputs),) = calls
    return outputs, backward_arguments, backward_outputs, grads


def gdn_forward_backward(a, monkeypatch):
    return forward_backward(GDN_FWD, GDN_BWD, "gated_delta_rule_bwd", fla_library._gdn_setup_context,
                            fla_library._gdn_backward, a, monkeypatch)  # fmt: skip


PASSED_THROUGH = ("scale", "initial_state", "state_v_first", "cu_seqlens", "use_gate_in_kernel", "A_log", "dt_bias",
                  "chunk_size")  # fmt: skip


@pytest.mark.parametrize("layer", [True, False], ids=["layer-flags-varlen", "no-flags-batch"])
def test_gated_delta_rule_forward_calls_fla_as_its_function_does(layer, fla_calls):
    a = gdn_arguments(layer)
    o, state, q_normed, q_rstd, k_normed, k_rstd, g_cumsum, beta_act, A = GDN_FWD._init_fn(**a)
    l2norm, sigmoid = fla_calls["l2norm_fwd"], fla_calls["fused_beta_sigmoid_fwd"]
    assert same([x["x"] for x, _ in l2norm], [a["q"], a["k"]] if layer else [])
    assert same(
        [value for x, _ in sigmoid for value in (x["x"], x["scale"])], [a["beta"], 2.0] if layer else []
    )
    ((call, (fla_g, fla_o, fla_A, fla_state, _, _)),) = fla_calls["chunk_gated_delta_rule_fwd"]
    # the normalised q, k and the sigmoid of beta reach the delta rule; the rest as given
    activated = [l2norm[0][1][0], l2norm[1][1][0], sigmoid[0][1]] if layer else [a["q"], a["k"], a["beta"]]
    assert same([call[name] for name in ("q", "k", "beta")], activated)
    names = ("v", "g", "output_final_state", *PASSED_THROUGH)
    assert same([call[name] for name in names], [a[name] for name in names])
    indices = fla_calls["prepare_chunk_indices"]
    assert call["chunk_indices"] is (indices[0][1] if layer else None)
    assert same(
        [value for x, _ in indices for value in x.values()],
        [a["cu_seqlens"], CHUNK, a["cu_seqlens_cpu"]] if layer else [],
    )

    assert (o.shape, o.dtype) == (fla_o.shape, a["q"].dtype) and g_cumsum is fla_g and A is fla_A
    optional = [state, q_normed, q_rstd, k_normed, k_rstd, beta_act]
    if layer:
        assert same(optional, [fla_state, *l2norm[0][1], *l2norm[1][1], sigmoid[0][1]])
    else:  # custom ops may not return their inputs: what would be q, k or beta comes back empty, as does no state
        assert all(x.numel() == 0 for x in optional)


@pytest.mark.parametrize("layer", [True, False], ids=["layer-flags-varlen", "no-flags-batch"])
def test_gated_delta_rule_backward_calls_fla_as_its_function_does(layer, fla_calls, monkeypatch):
    a = gdn_arguments(layer)
    outputs, (do, dht, *_), op_grads, grads = gdn_forward_backward(a, monkeypatch)
    _, _, q_normed, q_rstd, k_normed, k_rstd, g_cumsum, beta_act, A = outputs
    assert len(fla_calls["serve_where_fla_refuses"]) == 1 and (dht is not None) == layer
    ((call, (fla_dq, fla_dk, _, fla_dbeta, *_)),) = fla_calls["chunk_gated_delta_rule_bwd"]
    saved = [q_normed, k_normed, beta_act, a["g"]] if layer else [a["q"], a["k"], a["beta"], None]
    assert same([call[name] for name in ("q", "k", "beta", "g_input")], saved)
    names = ("v", "g", "A", "do", "dht", "chunk_indices", *PASSED_THROUGH)
    indices = fla_calls["prepare_chunk_indices"][-1][1] if layer else None
    assert same(
        [call[name] for name in names],
        [a["v"], g_cumsum, A, do, dht, indices, *(a[n] for n in PASSED_THROUGH)],
    )
    l2norm = [value for x, _ in fla_calls["l2norm_bwd"] for value in (x["y"], x["rstd"], x["dy"])]
    assert same(l2norm, [q_normed, q_rstd, fla_dq, k_normed, k_rstd, fla_dk] if layer else [])
    sigmoid = [
        value for x, _ in fla_calls["fused_beta_sigmoid_bwd"] for value in (x["x"], x["dy"], x["scale"])
    ]
    assert same(sigmoid, [a["beta"], fla_dbeta, 2.0] if layer else [])

    # gradients in the dtypes of the inputs, absent ones empty; autograd turns the empty ones into None
    inputs = [a[name] for name in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")]
    check_like(op_grads[:5], inputs[:5])
    if layer:
        check_like(op_grads[5:], inputs[5:])
    else:
        assert all(x.numel() == 0 for x in op_grads[5:])
    dh0, dA_log, ddt_bias = op_grads[5:] if layer else [None] * 3
    # autograd's gradients, one per input of the forward op
    assert same(grads, [*op_grads[:5], dA_log, ddt_bias, dh0] + [None] * 10)


def strided_like(x: torch.Tensor) -> torch.Tensor:
    """x's values in a non-contiguous tensor (a transposed copy, transposed back)."""
    return x.transpose(0, -1).contiguous().transpose(0, -1) if x.ndim > 1 else x.repeat_interleave(2)[::2]


def test_gated_delta_rule_ops_give_fla_contiguous_tensors(fla_calls):
    """FLA's kernels index every tensor as contiguous (its Functions' input_guard makes them so); the gradient of
    a sum is an expanded tensor of stride 0, which a kernel would read past its storage (it did on the GPU)."""
    a = gdn_arguments(layer=True)
    a.update({name: strided_like(a[name]) for name in ("q", "k", "v", "g", "beta", "A_log", "initial_state")})
    assert not any(a[name].is_contiguous() for name in ("q", "v", "g", "initial_state"))
    outputs = GDN_FWD._init_fn(**a)
    do, dht = torch.ones(()).expand_as(outputs[0]), torch.ones(()).expand_as(outputs[1])
    backward_arguments = (do, dht, a["q"], None, a["k"], None, a["v"], a["g"], outputs[6], a["beta"], outputs[7],
                          strided_like(outputs[8]), a["A_log"], a["dt_bias"], a["initial_state"], a["cu_seqlens"],
                          a["cu_seqlens_cpu"], a["scale"], False, True, True, True, True, CHUNK)  # fmt: skip
    GDN_BWD._init_fn(*backward_arguments)
    received = [
        (name, value)
        for function in ("chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd", "l2norm_fwd")
        for call, _ in fla_calls[function]
        for name, value in call.items()
        if isinstance(value, torch.Tensor)
    ]
    assert len(received) > 20
    assert [name for name, value in received if not value.is_contiguous()] == []


@pytest.mark.parametrize("layer", [True, False], ids=["layer-flags-varlen", "no-flags-batch"])
def test_gated_delta_rule_fakes_agree_with_the_bodies(layer, fla_calls, monkeypatch):
    a = gdn_arguments(layer)
    outputs, backward_arguments, backward_outputs, _ = gdn_forward_backward(a, monkeypatch)
    check_like(GDN_BWD._abstract_fn(*backward_arguments), backward_outputs)
    check_like(GDN_FWD._abstract_fn(**a), outputs)


def test_recorders_reject_an_argument_fla_does_not_take(fla_calls, monkeypatch):
    """Each recorder binds: a call replayed with its own arguments passes, with one more keyword it fails."""
    gdn_forward_backward(gdn_arguments(layer=True), monkeypatch)
    delta_forward_backward(delta_arguments(layer=True), monkeypatch)
    for module, name in INTERNALS:
        (arguments, _), *_ = fla_calls[name]
        getattr(module, name)(**arguments)
        with pytest.raises(TypeError, match="bogus"):
            getattr(module, name)(**arguments, bogus=None)


def test_the_gated_delta_rule_wrapper_refuses_fla_context_parallelism():
    q = torch.zeros(1, T, H, K)
    with pytest.raises(ValueError, match="cp_context"):
        fla_library.chunk_gated_delta_rule(q, q, q, q[..., 0], q[..., 0], cp_context=object())


def delta_arguments(layer: bool):
    """bf16 inputs with the flags of flame's DeltaNet layer on packed documents and a state in and out, or with none
    of them (a batch, no state)."""
    dtype = torch.bfloat16
    batch, cu_seqlens = (1, torch.tensor([0, 5, 8])) if layer else (B, None)
    q, k, v = (torch.randn(batch, T, H, dim, dtype=dtype) for dim in (K, K, V))
    return dict(
        q=q, k=k, v=v, beta=torch.rand(batch, T, H, dtype=dtype),
        initial_state=torch.randn(2, H, K, V, dtype=dtype) if layer else None, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens.clone() if layer else None, scale=0.5, output_final_state=layer,
        use_qk_l2norm_in_kernel=layer, chunk_size=CHUNK,
    )  # fmt: skip


def delta_forward_backward(a, monkeypatch):
    return forward_backward(DELTA_FWD, DELTA_BWD, "delta_rule_bwd", fla_library._delta_setup_context,
                            fla_library._delta_backward, a, monkeypatch)  # fmt: skip


@pytest.mark.parametrize("layer", [True, False], ids=["layer-flags-varlen", "no-flags-batch"])
def test_delta_rule_forward_calls_fla_as_its_function_does(layer, fla_calls):
    a = delta_arguments(layer)
    o, state, q_normed, q_rstd, k_normed, k_rstd, A = DELTA_FWD._init_fn(**a)
    l2norm = fla_calls["l2norm_fwd"]
    assert same([x["x"] for x, _ in l2norm], [a["q"], a["k"]] if layer else [])
    ((call, (fla_o, fla_A, fla_state)),) = fla_calls["chunk_delta_rule_fwd"]
    # the normalised q, k reach the delta rule; the rest as given
    assert same([call["q"], call["k"]], [l2norm[0][1][0], l2norm[1][1][0]] if layer else [a["q"], a["k"]])
    names = ("v", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens", "chunk_size")
    assert same([call[name] for name in names], [a[name] for name in names])
    indices = fla_calls["prepare_chunk_indices"]
    assert call["chunk_indices"] is (indices[0][1] if layer else None)

    assert (o.shape, o.dtype) == (fla_o.shape, a["q"].dtype) and A is fla_A
    optional = [state, q_normed, q_rstd, k_normed, k_rstd]
    if layer:
        assert same(optional, [fla_state, *l2norm[0][1], *l2norm[1][1]])
    else:  # custom ops may not return their inputs: what would be q or k comes back empty, as does no state
        assert all(x.numel() == 0 for x in optional)


@pytest.mark.parametrize("layer", [True, False], ids=["layer-flags-varlen", "no-flags-batch"])
def test_delta_rule_backward_calls_fla_as_its_function_does(layer, fla_calls, monkeypatch):
    a = delta_arguments(layer)
    outputs, (do, dht, *_), op_grads, grads = delta_forward_backward(a, monkeypatch)
    _, _, q_normed, q_rstd, k_normed, k_rstd, A = outputs
    assert (dht is not None) == layer
    ((call, (fla_dq, fla_dk, *_)),) = fla_calls["chunk_delta_rule_bwd"]
    assert same([call["q"], call["k"]], [q_normed, k_normed] if layer else [a["q"], a["k"]])
    names = (
        "v",
        "beta",
        "A",
        "do",
        "dht",
        "chunk_indices",
        "scale",
        "initial_state",
        "cu_seqlens",
        "chunk_size",
    )
    indices = fla_calls["prepare_chunk_indices"][-1][1] if layer else None
    assert same(
        [call[name] for name in names],
        [a["v"], a["beta"], A, do, dht, indices, a["scale"], a["initial_state"], a["cu_seqlens"], CHUNK],
    )
    l2norm = [value for x, _ in fla_calls["l2norm_bwd"] for value in (x["y"], x["rstd"], x["dy"])]
    assert same(l2norm, [q_normed, q_rstd, fla_dq, k_normed, k_rstd, fla_dk] if layer else [])

    # gradients in the dtypes of the inputs, an absent one empty; autograd turns the empty one into None
    inputs = [a[name] for name in ("q", "k", "v", "beta", "initial_state")]
    check_like(op_grads[:4], inputs[:4])
    if layer:
        check_like(op_grads[4:], inputs[4:])
    else:
        assert op_grads[4].numel() == 0
    # autograd's gradients, one per input of the forward op
    assert same(grads, [*op_grads[:4], op_grads[4] if layer else None] + [None] * 6)


@pytest.mark.parametrize("layer", [True, False], ids=["layer-flags-varlen", "no-flags-batch"])
def test_delta_rule_fakes_agree_with_the_bodies(layer, fla_calls, monkeypatch):
    a = delta_arguments(layer)
    outputs, backward_arguments, backward_outputs, _ = delta_forward_backward(a, monkeypatch)
    check_like(DELTA_BWD._abstract_fn(*backward_arguments), backward_outputs)
    check_like(DELTA_FWD._abstract_fn(**a), outputs)


def test_delta_rule_ops_give_fla_contiguous_tensors(fla_calls):
    a = delta_arguments(layer=True)
    a.update({name: strided_like(a[name]) for name in ("q", "k", "v", "beta", "initial_state")})
    assert not any(a[name].is_contiguous() for name in ("q", "v", "beta", "initial_state"))
    outputs = DELTA_FWD._init_fn(**a)
    do, dht = torch.ones(()).expand_as(outputs[0]), torch.ones(()).expand_as(outputs[1])
    DELTA_BWD._init_fn(do, dht, a["q"], None, a["k"], None, a["v"], a["beta"], strided_like(outputs[6]),
                       a["initial_state"], a["cu_seqlens"], a["cu_seqlens_cpu"], a["scale"], False, CHUNK)  # fmt: skip
    received = [
        (name, value)
        for function in ("chunk_delta_rule_fwd", "chunk_delta_rule_bwd", "l2norm_fwd")
        for call, _ in fla_calls[function]
        for name, value in call.items()
        if isinstance(value, torch.Tensor)
    ]
    assert len(received) > 15
    assert [name for name, value in received if not value.is_contiguous()] == []
