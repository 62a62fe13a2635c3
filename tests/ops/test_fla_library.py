"""The bodies of flame.ops.fla_library's custom ops on CPU, with FLA's internal functions replaced by recorders.

The custom ops call FLA 0.6.0's internal functions (the kernels of both delta rules one by one, in the order of
FLA's chunk_gated_delta_rule_fwd / _bwd and chunk_delta_rule_fwd / _bwd; l2norm_fwd / _bwd, fused_beta_sigmoid_fwd
/ _bwd, prepare_chunk_indices), not its public API, so a new FLA release may rename their arguments or change what they
return. Their Triton kernels need a GPU (tests/gpu/test_fla_library.py runs them); here each recorder binds its call
to the real function's signature (an argument name FLA does not accept raises TypeError) and returns CPU tensors of
the shapes and dtypes FLA's source returns, so API drift and wiring mistakes show on CPU CI. flame's compositions
of each rule's kernels are compared call by call with FLA's own functions run on the same recorders. The fake
(shape-only) implementations are compared with what the bodies return.
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
from flame.ops.gated_delta_rule import dhu_triton, fwd_o_triton

B, T, H, HV, K, V, CHUNK = 2, 8, 2, 4, 4, 3, 32  # K != V: a transposed state layout shows in the shapes
# torch's CustomOpDef keeps the decorated function as _init_fn and the register_fake one as _abstract_fn.
GDN_FWD, GDN_BWD = fla_library.gated_delta_rule_fwd, fla_library.gated_delta_rule_bwd
DELTA_FWD, DELTA_BWD = fla_library.delta_rule_fwd, fla_library.delta_rule_bwd


def f32(*shape):
    return torch.empty(*shape, dtype=torch.float32)


def chunks(a) -> int:
    """The chunks of a call: of each row, or of the packed documents (the chunk indices' rows)."""
    if a["cu_seqlens"] is None:
        return -(-a["k"].shape[1] // a["chunk_size"])
    return len(a["chunk_indices"])


def state_shape(a) -> tuple[int, int]:
    return (V, K) if a["state_v_first"] else (K, V)


def fwd_h(a):  # (h per chunk, v_new, final state)
    batch, heads = a["k"].shape[0], a["u"].shape[2]
    states = batch if a["cu_seqlens"] is None else len(a["cu_seqlens"]) - 1
    final = f32(states, heads, *state_shape(a)) if a["output_final_state"] else None
    return a["k"].new_empty(batch, chunks(a), heads, *state_shape(a)), torch.empty_like(a["u"]), final


def w_u(a):  # the WY keys w [B, T, HV, K] and new values u, as recompute_w_u_fwd
    return a["k"].new_empty(*a["v"].shape[:3], K), torch.empty_like(a["v"])


# FLA's namespace of the gated delta rule's kernels: its chunk_gated_delta_rule_fwd / _bwd call them from there, and
# so do flame's custom ops.
FLA_GDN = fla.ops.gated_delta_rule.chunk
# What each returns (per FLA's source), given its bound arguments.
GDN_KERNELS = {
    "gdn_gate_chunk_cumsum": lambda a: f32(*a["g"].shape),
    "chunk_local_cumsum": lambda a: f32(*a["g"].shape),
    "chunk_gated_delta_rule_fwd_intra": lambda a: (
        *w_u(a),
        a["k"].new_empty(*a["v"].shape[:3], a["chunk_size"]),
    ),
    "chunk_gated_delta_rule_fwd_h": fwd_h,
    "chunk_fwd_o": lambda a: torch.empty_like(a["v"]),
    "recompute_w_u_fwd": w_u,
    "chunk_bwd_dv_local": lambda a: torch.empty_like(a["do"]),
    "chunk_gated_delta_rule_bwd_dhu": lambda a: (
        a["q"].new_empty(a["q"].shape[0], chunks(a), a["do"].shape[2], *state_shape(a)),
        None if a["h0"] is None else f32(*a["h0"].shape),
        torch.empty_like(a["dv"]),
    ),
    "chunk_bwd_dqkwg": lambda a: (
        torch.empty_like(a["q"]),
        torch.empty_like(a["k"]),
        torch.empty_like(a["w"]),
        None if a["g"] is None else f32(*a["g"].shape),
    ),  # fmt: skip
    "prepare_wy_repr_bwd": lambda a: (
        torch.empty_like(a["k"]),
        torch.empty_like(a["v"]),
        torch.empty_like(a["beta"]),
        torch.empty_like(a["g"]),
    ),  # fmt: skip
    "gdn_gate_bwd": lambda a: (torch.empty_like(a["g"]), f32(HV), None if a["dt_bias"] is None else f32(HV)),
}


# FLA's namespace of the delta rule's kernels (the gated rule's state recurrence and output kernels, with g None, and
# its own WY representation), from which its chunk_delta_rule_fwd / _bwd and flame's custom ops call them.
FLA_DELTA = fla.ops.delta_rule.chunk
DELTA_KERNELS = {
    **{name: GDN_KERNELS[name] for name in ("chunk_gated_delta_rule_fwd_h", "chunk_fwd_o", "recompute_w_u_fwd",
                                            "chunk_bwd_dv_local", "chunk_gated_delta_rule_bwd_dhu", "chunk_bwd_dqkwg")},
    "prepare_wy_repr_fwd": lambda a: (*w_u(a), a["k"].new_empty(*a["v"].shape[:3], a["chunk_size"])),
    "prepare_wy_repr_bwd": lambda a: tuple(torch.empty_like(a[name]) for name in ("k", "v", "beta")),
}  # fmt: skip


def label(module, name: str) -> str:
    """The name a recorded function goes by in the calls: the delta rule's kernels carry their namespace, since the
    gated rule's namespace holds the same names."""
    return f"delta_rule.{name}" if module is FLA_DELTA else name


# (module, name) of each FLA function the ops call: what it returns (per FLA's source), given its bound arguments
INTERNALS = {
    (fla.modules.norm.l2norm, "l2norm_fwd"): lambda a: (torch.empty_like(a["x"]), f32(*a["x"].shape[:-1])),
    (fla.modules.norm.l2norm, "l2norm_bwd"): lambda a: torch.empty_like(a["y"]),
    (fla.ops.common.gate, "fused_beta_sigmoid_fwd"): lambda a: torch.empty_like(a["x"], dtype=torch.float32),
    (fla.ops.common.gate, "fused_beta_sigmoid_bwd"): lambda a: torch.empty_like(a["x"]),
    (fla.ops.utils.index, "prepare_chunk_indices"): lambda a: torch.zeros(2, 2, dtype=torch.long),
    **{(FLA_GDN, name): result for name, result in GDN_KERNELS.items()},
    (flame.ops.gated_delta_rule.dqkwg_triton, "serve_where_fla_refuses"): lambda a: None,
    **{(FLA_DELTA, name): result for name, result in DELTA_KERNELS.items()},
}


def recorder(real, name, result, calls, sequence):
    """Binds each call to real's signature (which follows decorators' __wrapped__), records it in ``calls`` and,
    with ``name``, in ``sequence``, and returns result."""
    signature = inspect.signature(real)

    def record(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append((bound.arguments, result(bound.arguments)))
        sequence.append((name, *calls[-1]))
        return calls[-1][1]

    return record


SEQUENCE = "in order"


def patch_with_recorders(monkeypatch, functions: dict, calls: dict) -> None:
    for (module, name), result in functions.items():
        key = label(module, name)
        calls[key] = []
        real = getattr(module, name)
        monkeypatch.setattr(module, name, recorder(real, key, result, calls[key], calls[SEQUENCE]))


@pytest.fixture
def fla_calls(monkeypatch):
    """Replaces FLA's internals by recorders; returns {name: [(bound arguments, result), ...]}, and under
    SEQUENCE every call in order as (name, bound arguments, result)."""
    calls = {SEQUENCE: []}
    patch_with_recorders(monkeypatch, INTERNALS, calls)
    return calls


def gdn_forward_result(a):  # _gdn_forward's (g cumsum, o, A, final state, w, h, v_new)
    batch = a["v"].shape[0]
    states = batch if a["cu_seqlens"] is None else len(a["cu_seqlens"]) - 1
    state = f32(states, HV, *state_shape(a)) if a["output_final_state"] else None
    w, u = w_u(a)
    h = a["k"].new_empty(batch, chunks(a), HV, *state_shape(a))
    return (
        f32(batch, T, HV),
        torch.empty_like(a["v"]),
        a["k"].new_empty(batch, T, HV, a["chunk_size"]),
        state,
        w,
        h,
        u,
    )


def gdn_backward_result(a):  # _gdn_backward's (dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias)
    gate, h0 = a["use_gate_in_kernel"], a["initial_state"]
    return (*(torch.empty_like(a[name]) for name in ("q", "k", "v", "beta")), f32(*a["g"].shape),
            None if h0 is None else f32(*h0.shape), f32(HV) if gate else None,
            f32(HV) if gate and a["dt_bias"] is not None else None)  # fmt: skip


@pytest.fixture
def gdn_calls(fla_calls, monkeypatch):
    """fla_calls, with flame's composition of the gated delta rule's kernels (fla_library._gdn_forward and
    _gdn_backward, compared with FLA's own below) recorded instead of run: what the custom ops hand it."""
    compositions = {(fla_library, "_gdn_forward"): gdn_forward_result,
                    (fla_library, "_gdn_backward"): gdn_backward_result}  # fmt: skip
    patch_with_recorders(monkeypatch, compositions, fla_calls)
    return fla_calls


def symbolic(sequence, names: dict[int, str]) -> tuple[list[tuple[str, dict]], dict[int, str]]:
    """The calls of ``sequence`` with each tensor argument named: by ``names`` (id -> name) when given there, else
    as the output of an earlier call ("kernel#n[i]": output i of the kernel's n-th call); other arguments as they
    are. Two runs that call the same kernels with the same inputs and each other's outputs in the same places give
    equal lists. Returns the calls and the names, those of the calls' outputs added."""
    names, seen, calls = dict(names), {}, []
    for name, arguments, result in sequence:
        calls.append(
            (
                name,
                {
                    key: names.get(id(value), "unnamed tensor") if isinstance(value, torch.Tensor) else value
                    for key, value in arguments.items()
                },
            )  # fmt: skip
        )
        count = seen[name] = seen.get(name, -1) + 1
        for index, output in enumerate(result if isinstance(result, tuple) else (result,)):
            if isinstance(output, torch.Tensor):
                names.setdefault(id(output), f"{name}#{count}[{index}]")
    return calls, names


def named(values, names: dict[int, str]) -> list:
    return [names.get(id(x), "unnamed tensor") if isinstance(x, torch.Tensor) else x for x in values]


def same(actual, expected):
    """The same tensors (and None), equal other values."""
    return len(actual) == len(expected) and all(
        x is y if y is None or isinstance(y, torch.Tensor) else x == y for x, y in zip(actual, expected)
    )


def check_like(actual, expected):
    assert [(x.shape, x.dtype) for x in actual] == [(x.shape, x.dtype) for x in expected]


LAYER_CASES = {
    "layer-flags-varlen": (True, True),
    "layer-flags-batch": (True, False),
    "no-flags-batch": (False, False),
}


def gdn_arguments(layer: bool, varlen: bool, save_states: bool = True):
    """The custom forward op's arguments: bf16 inputs (as under FSDP's mixed precision) with the flags of flame's
    GatedDeltaNet layer and a state in and out, or with none of them and no state; packed documents or a batch."""
    dtype = torch.bfloat16
    batch, cu_seqlens = (1, torch.tensor([0, 5, 8])) if varlen else (B, None)
    q, k, v = (torch.randn(batch, T, heads, dim, dtype=dtype) for heads, dim in ((H, K), (H, K), (HV, V)))
    g, beta = (torch.randn(batch, T, HV, dtype=dtype) for _ in range(2))
    flags = ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
             "use_gate_in_kernel", "output_final_state")  # fmt: skip
    return dict(
        q=q, k=k, v=v, g=g, beta=beta, A_log=torch.randn(HV, dtype=dtype) if layer else None,
        dt_bias=torch.randn(HV, dtype=dtype) if layer else None,
        initial_state=torch.randn(2 if varlen else batch, HV, V, K, dtype=dtype) if layer else None,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens.clone() if varlen else None, scale=0.5, chunk_size=CHUNK,
        **dict.fromkeys(flags, layer), save_states=save_states,
    )  # fmt: skip


def forward_backward(forward_op, backward_op, backward_name, setup_context, backward, a, monkeypatch):
    """The forward op's body, then autograd's setup_context and backward with the backward op's body for the op.
    Returns (forward outputs, backward op arguments, backward op outputs, gradients for the forward's inputs)."""
    outputs, calls = forward_op._init_fn(**a), []

    def recorded_backward_op(*args):
        calls.append((args, backward_op._init_fn(*args)))
        return calls[-1][1]

    monkeypatch.setattr(fla_library, backward_name, recorded_backward_op)
    ctx = SimpleNamespace(mark_non_differentiable=lambda *_: None, set_materialize_grads=lambda _: None)
    ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
    inputs = tuple(a[name] for name in inspect.signature(forward_op._init_fn).parameters)
    setup_context(ctx, inputs, outputs)
    do, dht = torch.randn_like(outputs[0]), torch.randn_like(outputs[1])
    grads = backward(ctx, do, dht, *([None] * (len(outputs) - 2)))
    ((backward_arguments, backward_outputs),) = calls
    return outputs, backward_arguments, backward_outputs, grads


def gdn_forward_backward(a, monkeypatch):
    return forward_backward(GDN_FWD, GDN_BWD, "gated_delta_rule_bwd", fla_library._gdn_setup_context,
                            fla_library._gdn_autograd_backward, a, monkeypatch)  # fmt: skip


PASSED_THROUGH = ("scale", "initial_state", "state_v_first", "cu_seqlens", "use_gate_in_kernel", "A_log", "dt_bias",
                  "chunk_size")  # fmt: skip


def kernel_inputs(layer: bool, varlen: bool) -> dict:
    """The arguments of FLA's chunk_gated_delta_rule_fwd and _bwd (and flame's compositions), backward's
    included."""
    a = gdn_arguments(layer, varlen)
    batch = a["q"].shape[0]
    return dict(
        q=a["q"], k=a["k"], v=a["v"], g=f32(batch, T, HV), beta=a["beta"], scale=0.5,
        initial_state=a["initial_state"], output_final_state=layer, state_v_first=layer, cu_seqlens=a["cu_seqlens"],
        chunk_indices=torch.zeros(2, 2, dtype=torch.long) if varlen else None, use_gate_in_kernel=layer,
        A_log=a["A_log"], dt_bias=a["dt_bias"], chunk_size=CHUNK, A=a["k"].new_empty(batch, T, HV, CHUNK),
        do=torch.randn_like(a["v"]), dht=f32(*a["initial_state"].shape) if layer else None,
        g_input=a["g"] if layer else None,
    )  # fmt: skip


def input_names(inputs: dict) -> dict[int, str]:
    return {id(value): name for name, value in inputs.items() if isinstance(value, torch.Tensor)}


FORWARD_ARGUMENTS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "state_v_first",
                     "cu_seqlens", "chunk_indices", "use_gate_in_kernel", "A_log", "dt_bias", "chunk_size")  # fmt: skip
BACKWARD_ARGUMENTS = ("q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht", "state_v_first",
                      "cu_seqlens", "chunk_indices", "use_gate_in_kernel", "g_input", "A_log", "dt_bias",
                      "chunk_size")  # fmt: skip


@pytest.mark.parametrize("save_states", [True, False], ids=["save", "recompute"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_gated_delta_rule_forward_op_passes_what_fla_function_passes(case, save_states, gdn_calls):
    layer, varlen = LAYER_CASES[case]
    a = gdn_arguments(layer, varlen, save_states)
    o, state, q_normed, q_rstd, k_normed, k_rstd, g_cumsum, beta_act, A, w, h, v_new = GDN_FWD._init_fn(**a)
    l2norm, sigmoid = gdn_calls["l2norm_fwd"], gdn_calls["fused_beta_sigmoid_fwd"]
    assert same([x["x"] for x, _ in l2norm], [a["q"], a["k"]] if layer else [])
    assert same(
        [value for x, _ in sigmoid for value in (x["x"], x["scale"])], [a["beta"], 2.0] if layer else []
    )
    ((call, (fla_g, fla_o, fla_A, fla_state, fla_w, fla_h, fla_v_new)),) = gdn_calls["_gdn_forward"]
    # the normalised q, k and the sigmoid of beta reach the delta rule; the rest as given
    activated = [l2norm[0][1][0], l2norm[1][1][0], sigmoid[0][1]] if layer else [a["q"], a["k"], a["beta"]]
    assert same([call[name] for name in ("q", "k", "beta")], activated)
    names = ("v", "g", "output_final_state", *PASSED_THROUGH)
    assert same([call[name] for name in names], [a[name] for name in names])
    indices = gdn_calls["prepare_chunk_indices"]
    assert call["chunk_indices"] is (indices[0][1] if varlen else None)
    assert same(
        [value for x, _ in indices for value in x.values()],
        [a["cu_seqlens"], CHUNK, a["cu_seqlens_cpu"]] if varlen else [],
    )

    assert (o.shape, o.dtype) == (fla_o.shape, a["q"].dtype) and g_cumsum is fla_g and A is fla_A
    optional = [state, q_normed, q_rstd, k_normed, k_rstd, beta_act]
    if layer:
        assert same(optional, [fla_state, *l2norm[0][1], *l2norm[1][1], sigmoid[0][1]])
    else:  # custom ops may not return their inputs: what would be q, k or beta comes back empty, as does no state
        assert all(x.numel() == 0 for x in optional)
    # The state recurrence's results: kept for the backward when asked to, except for packed documents.
    if save_states and not varlen:
        assert same([w, h, v_new], [fla_w, fla_h, fla_v_new])
    else:
        assert all(x.numel() == 0 for x in (w, h, v_new))


@pytest.mark.parametrize("save_states", [True, False], ids=["save", "recompute"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_gated_delta_rule_backward_op_passes_what_fla_function_passes(
    case, save_states, gdn_calls, monkeypatch
):
    layer, varlen = LAYER_CASES[case]
    a = gdn_arguments(layer, varlen, save_states)
    outputs, (do, dht, *_), op_grads, grads = gdn_forward_backward(a, monkeypatch)
    _, _, q_normed, q_rstd, k_normed, k_rstd, g_cumsum, beta_act, A, w, h, v_new = outputs
    assert len(gdn_calls["serve_where_fla_refuses"]) == 1 and (dht is not None) == layer
    ((call, (fla_dq, fla_dk, _, fla_dbeta, *_)),) = gdn_calls["_gdn_backward"]
    saved = [q_normed, k_normed, beta_act, a["g"]] if layer else [a["q"], a["k"], a["beta"], None]
    assert same([call[name] for name in ("q", "k", "beta", "g_input")], saved)
    names = ("v", "g", "A", "do", "dht", "chunk_indices", *PASSED_THROUGH)
    indices = gdn_calls["prepare_chunk_indices"][-1][1] if varlen else None
    assert same(
        [call[name] for name in names],
        [a["v"], g_cumsum, A, do, dht, indices, *(a[n] for n in PASSED_THROUGH)],
    )
    kept = save_states and not varlen
    assert same([call[name] for name in ("w", "h", "v_new")], [w, h, v_new] if kept else [None] * 3)
    l2norm = [value for x, _ in gdn_calls["l2norm_bwd"] for value in (x["y"], x["rstd"], x["dy"])]
    assert same(l2norm, [q_normed, q_rstd, fla_dq, k_normed, k_rstd, fla_dk] if layer else [])
    sigmoid = [
        value for x, _ in gdn_calls["fused_beta_sigmoid_bwd"] for value in (x["x"], x["dy"], x["scale"])
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
    assert same(grads, [*op_grads[:5], dA_log, ddt_bias, dh0] + [None] * 11)


def test_the_chunk_states_policy_reaches_the_forward_ops(monkeypatch):
    """set_chunk_states decides each forward op's save_states (and so whether FLA's state recurrence runs twice)."""
    seen = []
    for op in ("gated_delta_rule_fwd", "delta_rule_fwd"):
        monkeypatch.setattr(fla_library, op, lambda *args, op=op: seen.append((op, args[-1])) or (None, None))
    q = torch.zeros(1, T, H, K)
    assert not fla_library.saves_chunk_states()  # FLA's way unless a job asks
    try:
        for policy in ("recompute", "save"):
            fla_library.set_chunk_states(policy)
            fla_library.chunk_gated_delta_rule(q, q, q, q[..., 0], q[..., 0])
            fla_library.chunk_delta_rule(q, q, q, q[..., 0])
    finally:
        fla_library.set_chunk_states("recompute")
    assert seen == [("gated_delta_rule_fwd", False), ("delta_rule_fwd", False),
                    ("gated_delta_rule_fwd", True), ("delta_rule_fwd", True)]  # fmt: skip
    with pytest.raises(ValueError, match="chunk states must be one of"):
        fla_library.set_chunk_states("keep")


def strided_like(x: torch.Tensor) -> torch.Tensor:
    """x's values in a non-contiguous tensor (a transposed copy, transposed back)."""
    return x.transpose(0, -1).contiguous().transpose(0, -1) if x.ndim > 1 else x.repeat_interleave(2)[::2]


def test_gated_delta_rule_ops_give_fla_contiguous_tensors(fla_calls):
    """FLA's kernels index every tensor as contiguous (its Functions' input_guard makes them so); the gradient of
    a sum is an expanded tensor of stride 0, which a kernel would read past its storage (it did on the GPU)."""
    a = gdn_arguments(layer=True, varlen=True)
    a.update({name: strided_like(a[name]) for name in ("q", "k", "v", "g", "beta", "A_log", "initial_state")})
    assert not any(a[name].is_contiguous() for name in ("q", "v", "g", "initial_state"))
    outputs = GDN_FWD._init_fn(**a)
    do, dht = torch.ones(()).expand_as(outputs[0]), torch.ones(()).expand_as(outputs[1])
    backward_arguments = (do, dht, a["q"], None, a["k"], None, a["v"], a["g"], outputs[6], a["beta"], outputs[7],
                          strided_like(outputs[8]), a["A_log"], a["dt_bias"], a["initial_state"], a["cu_seqlens"],
                          a["cu_seqlens_cpu"], None, None, None, a["scale"], False, True, True, True, True,
                          CHUNK)  # fmt: skip
    GDN_BWD._init_fn(*backward_arguments)
    received = [
        (f"{function}.{name}", value)
        for function, call, _ in fla_calls[SEQUENCE]
        for name, value in call.items()
        if isinstance(value, torch.Tensor)
    ]
    assert len(received) > 40
    assert [name for name, value in received if not value.is_contiguous()] == []


@pytest.mark.parametrize("save_states", [True, False], ids=["save", "recompute"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_gated_delta_rule_fakes_agree_with_the_bodies(case, save_states, fla_calls, monkeypatch):
    a = gdn_arguments(*LAYER_CASES[case], save_states)
    outputs, backward_arguments, backward_outputs, _ = gdn_forward_backward(a, monkeypatch)
    check_like(GDN_BWD._abstract_fn(*backward_arguments), backward_outputs)
    check_like(GDN_FWD._abstract_fn(**a), outputs)


def test_recorders_reject_an_argument_fla_does_not_take(fla_calls, monkeypatch):
    """Each recorder binds: a call replayed with its own arguments passes, with one more keyword it fails (unless
    FLA's function takes any keyword: chunk_local_cumsum's ``**kwargs``)."""
    gdn_forward_backward(gdn_arguments(layer=True, varlen=True), monkeypatch)
    delta_forward_backward(delta_arguments(layer=True), monkeypatch)
    for module, name in INTERNALS:
        (arguments, _), *_ = fla_calls[label(module, name)]
        getattr(module, name)(**arguments)
        if "kwargs" in arguments:
            continue
        with pytest.raises(TypeError, match="bogus"):
            getattr(module, name)(**arguments, bogus=None)


def test_the_gated_delta_rule_wrapper_refuses_fla_context_parallelism():
    q = torch.zeros(1, T, H, K)
    with pytest.raises(ValueError, match="cp_context"):
        fla_library.chunk_gated_delta_rule(q, q, q, q[..., 0], q[..., 0], cp_context=object())


def delta_arguments(layer: bool, save_states: bool = True):
    """bf16 inputs with the flags of flame's DeltaNet layer on packed documents and a state in and out, or with none
    of them (a batch, no state)."""
    dtype = torch.bfloat16
    batch, cu_seqlens = (1, torch.tensor([0, 5, 8])) if layer else (B, None)
    q, k, v = (torch.randn(batch, T, H, dim, dtype=dtype) for dim in (K, K, V))
    return dict(
        q=q, k=k, v=v, beta=torch.rand(batch, T, H, dtype=dtype),
        initial_state=torch.randn(2, H, K, V, dtype=dtype) if layer else None, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens.clone() if layer else None, scale=0.5, output_final_state=layer,
        use_qk_l2norm_in_kernel=layer, chunk_size=CHUNK, save_states=save_states,
    )  # fmt: skip


def delta_forward_backward(a, monkeypatch):
    return forward_backward(DELTA_FWD, DELTA_BWD, "delta_rule_bwd", fla_library._delta_setup_context,
                            fla_library._delta_autograd_backward, a, monkeypatch)  # fmt: skip


DELTA_CASES = {"layer-flags-varlen": True, "no-flags-batch": False}
DELTA_FORWARD_ARGUMENTS = ("q", "k", "v", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
                           "chunk_indices", "chunk_size")  # fmt: skip
DELTA_BACKWARD_ARGUMENTS = ("q", "k", "v", "beta", "A", "scale", "initial_state", "do", "dht", "cu_seqlens",
                            "chunk_indices", "chunk_size")  # fmt: skip


def delta_kernel_inputs(layer: bool) -> dict:
    """The arguments of FLA's chunk_delta_rule_fwd and _bwd (and flame's compositions), backward's included."""
    a = delta_arguments(layer)
    return dict(
        q=a["q"], k=a["k"], v=a["v"], beta=a["beta"], scale=0.5, initial_state=a["initial_state"],
        output_final_state=layer, cu_seqlens=a["cu_seqlens"],
        chunk_indices=torch.zeros(2, 2, dtype=torch.long) if layer else None, chunk_size=CHUNK,
        A=a["k"].new_empty(a["q"].shape[0], T, H, CHUNK), do=torch.randn_like(a["v"]),
        dht=f32(*a["initial_state"].shape) if layer else None,
    )  # fmt: skip


# Per rule: FLA's forward and backward, flame's compositions of the same kernels, their inputs for a case, their
# argument names, how many of the forward's results FLA's forward returns too, and the label prefix of its kernels.
RULES = {
    "gated": SimpleNamespace(
        fla=FLA_GDN, forward="chunk_gated_delta_rule_fwd", backward="chunk_gated_delta_rule_bwd",
        ours_forward="_gdn_forward", ours_backward="_gdn_backward", inputs=lambda case: kernel_inputs(*LAYER_CASES[case]),
        forward_arguments=FORWARD_ARGUMENTS, backward_arguments=BACKWARD_ARGUMENTS, shared=4, prefix="",
        wy="chunk_gated_delta_rule_fwd_intra", cases=LAYER_CASES,
    ),
    "delta": SimpleNamespace(
        fla=FLA_DELTA, forward="chunk_delta_rule_fwd", backward="chunk_delta_rule_bwd", ours_forward="_delta_forward",
        ours_backward="_delta_backward", inputs=lambda case: delta_kernel_inputs(DELTA_CASES[case]),
        forward_arguments=DELTA_FORWARD_ARGUMENTS, backward_arguments=DELTA_BACKWARD_ARGUMENTS, shared=3,
        prefix="delta_rule.", wy="delta_rule.prepare_wy_repr_fwd", cases=DELTA_CASES,
    ),
}  # fmt: skip
RULE_CASES = [(rule, case) for rule, spec in RULES.items() for case in spec.cases]


def run_fla(rule: str, case: str, direction: str, fla_calls):
    """FLA's forward or backward (``direction``) of the rule on the case's inputs, its calls then cleared: (spec,
    inputs, the call's arguments, FLA's results, its calls and the names of their outputs, as ``symbolic`` gives)."""
    spec = RULES[rule]
    inputs = spec.inputs(case)
    arguments = {name: inputs[name] for name in getattr(spec, f"{direction}_arguments")}
    theirs = getattr(spec.fla, getattr(spec, direction))(**arguments)
    fla_sequence, fla_names = symbolic(fla_calls[SEQUENCE], input_names(inputs))
    fla_calls[SEQUENCE].clear()
    return spec, inputs, arguments, theirs, fla_sequence, fla_names


@pytest.mark.parametrize(("rule", "case"), RULE_CASES, ids=[f"{rule}-{case}" for rule, case in RULE_CASES])
def test_forward_runs_fla_kernels_as_fla_does(rule, case, fla_calls):
    """flame's forward of each rule calls FLA's kernels as FLA's forward (chunk_gated_delta_rule_fwd,
    chunk_delta_rule_fwd) does, and returns what they made, w, h and v_new (the state recurrence's results)
    included."""
    # theirs, gated: (g, o, A, final state, initial state, g_input); plain: (o, A, final state)
    spec, inputs, arguments, theirs, fla_sequence, fla_names = run_fla(rule, case, "forward", fla_calls)
    ours = getattr(fla_library, spec.ours_forward)(**arguments, keep=True)
    sequence, names = symbolic(fla_calls[SEQUENCE], input_names(inputs))
    assert [name for name, _ in sequence] == [name for name, _ in fla_sequence]
    assert sequence == fla_sequence
    assert named(ours[: spec.shared], names) == named(theirs[: spec.shared], fla_names)
    wy, fwd_h = f"{spec.wy}#0", f"{spec.prefix}chunk_gated_delta_rule_fwd_h#0"
    assert named(ours[spec.shared :], names) == [f"{wy}[0]", f"{fwd_h}[0]", f"{fwd_h}[1]"]


@pytest.mark.parametrize(("rule", "case"), RULE_CASES, ids=[f"{rule}-{case}" for rule, case in RULE_CASES])
def test_forward_that_keeps_no_states_runs_the_state_recurrence_with_the_output(
    rule, case, fla_calls, monkeypatch
):
    """Where flame's kernel of the state recurrence and the output in one pass serves the call (fwd_o_triton.py,
    made to serve here) and the forward keeps no chunk states, it takes the place of FLA's two kernels with their
    arguments, and its o and final state take the place of theirs; h and v_new are not stored."""
    spec, inputs, arguments, theirs, fla_sequence, fla_names = run_fla(rule, case, "forward", fla_calls)

    def fused_result(a):
        states = a["k"].shape[0] if a["cu_seqlens"] is None else len(a["cu_seqlens"]) - 1
        final = f32(states, HV, *state_shape(a)) if a["output_final_state"] else None
        return torch.empty_like(a["u"]), final

    monkeypatch.setattr(fwd_o_triton, "serves", lambda k, chunk_size, state_v_first: True)
    patch_with_recorders(monkeypatch, {(fwd_o_triton, "chunk_fwd_o_triton"): fused_result}, fla_calls)
    ours = getattr(fla_library, spec.ours_forward)(**arguments, keep=False)
    sequence, names = symbolic(fla_calls[SEQUENCE], input_names(inputs))

    fwd_h, output = f"{spec.prefix}chunk_gated_delta_rule_fwd_h", f"{spec.prefix}chunk_fwd_o"
    assert [name for name, _ in fla_sequence[-2:]] == [fwd_h, output]
    (_, state_call), (_, output_call) = fla_sequence[-2:]
    fused_call = {**{key: state_call[key] for key in ("k", "w", "u", "g", "initial_state", "output_final_state",
                                                      "state_v_first", "chunk_size", "cu_seqlens", "chunk_indices")},
                  "q": output_call["q"], "scale": output_call["scale"], "launch": None}  # fmt: skip
    assert sequence == [*fla_sequence[:-2], ("chunk_fwd_o_triton", fused_call)]
    fused = "chunk_fwd_o_triton#0"
    outputs = named(ours[: spec.shared], names)
    expected = named(theirs[: spec.shared], fla_names)
    o_index, state_index = (1, 3) if rule == "gated" else (0, 2)
    has_state = theirs[state_index] is not None
    assert expected[o_index] == f"{output}#0[0]"
    assert expected[state_index] == (f"{fwd_h}#0[2]" if has_state else None)
    expected[o_index], expected[state_index] = f"{fused}[0]", f"{fused}[1]" if has_state else None
    assert outputs == expected
    assert ours[-2:] == (None, None)


@pytest.mark.parametrize(("rule", "case"), RULE_CASES, ids=[f"{rule}-{case}" for rule, case in RULE_CASES])
def test_backward_runs_fla_kernels_as_fla_does(rule, case, fla_calls):
    """flame's backward of each rule calls FLA's kernels as FLA's backward does; given the forward's w, h and v_new
    it leaves out the two kernels that recompute them and reads them where FLA reads its recomputed ones."""
    spec, inputs, arguments, theirs, fla_sequence, fla_names = run_fla(rule, case, "backward", fla_calls)
    recomputing = [f"{spec.prefix}recompute_w_u_fwd", f"{spec.prefix}chunk_gated_delta_rule_fwd_h"]
    assert [name for name, _ in fla_sequence[:2]] == recomputing
    assert recomputing[1] not in [name for name, _ in fla_sequence[2:]]
    ours_backward = getattr(fla_library, spec.ours_backward)

    ours = ours_backward(**arguments, w=None, h=None, v_new=None)
    sequence, names = symbolic(fla_calls[SEQUENCE], input_names(inputs))
    assert sequence == fla_sequence
    assert named(ours, names) == named(theirs, fla_names)

    fla_calls[SEQUENCE].clear()
    w, h, v_new = (torch.empty(0) for _ in range(3))  # stand-ins, named as FLA's recomputed ones
    states = {
        id(w): f"{recomputing[0]}#0[0]",
        id(h): f"{recomputing[1]}#0[0]",
        id(v_new): f"{recomputing[1]}#0[1]",
    }
    ours = ours_backward(**arguments, w=w, h=h, v_new=v_new)
    sequence, names = symbolic(fla_calls[SEQUENCE], input_names(inputs) | states)
    assert sequence == fla_sequence[2:]
    assert named(ours, names) == named(theirs, fla_names)


@pytest.mark.parametrize("forms_dv", [True, False], ids=["forms-dv", "takes-dv"])
@pytest.mark.parametrize(("rule", "case"), RULE_CASES, ids=[f"{rule}-{case}" for rule, case in RULE_CASES])
def test_backward_where_flames_dh_recurrence_serves(rule, case, forms_dv, fla_calls, monkeypatch):
    """Where flame's dh recurrence serves the call (dhu_triton.py, made to serve here) it takes the place of FLA's:
    called with its arguments, its results take the place of FLA's in the gradients of q, k and w and in the op's
    results. Where it forms the intra-chunk dv (forms_local_dv) it also takes the place of FLA's chunk_bwd_dv_local
    and is called without dv; elsewhere it takes chunk_bwd_dv_local's result."""
    spec, inputs, arguments, theirs, fla_sequence, fla_names = run_fla(rule, case, "backward", fla_calls)

    flames = inspect.signature(dhu_triton.chunk_bwd_dhu_triton).parameters
    monkeypatch.setattr(dhu_triton, "serves", lambda q, chunk_size, state_v_first: True)
    monkeypatch.setattr(dhu_triton, "forms_local_dv", lambda q, do: forms_dv)

    def dhu_result(a):  # (dh, dh0, dv2), dv2 like do
        return GDN_KERNELS["chunk_gated_delta_rule_bwd_dhu"]({**a, "dv": a["do"]})

    patch_with_recorders(monkeypatch, {(dhu_triton, "chunk_bwd_dhu_triton"): dhu_result}, fla_calls)
    ours = getattr(fla_library, spec.ours_backward)(**arguments, w=None, h=None, v_new=None)
    sequence, names = symbolic(fla_calls[SEQUENCE], input_names(inputs))

    dv_local, dhu = f"{spec.prefix}chunk_bwd_dv_local", f"{spec.prefix}chunk_gated_delta_rule_bwd_dhu"
    at = [name for name, _ in fla_sequence].index(dv_local)
    assert [name for name, _ in fla_sequence[at : at + 2]] == [dv_local, dhu]
    fla_dhu_call = fla_sequence[at + 1][1]
    # FLA's other arguments, left at their defaults: no per-key gates, no CUDA-graph chunk offsets
    assert {key: value for key, value in fla_dhu_call.items() if key not in flames} == dict(
        gk=None, chunk_offsets=None, use_graph=False
    )
    dhu_call = {key: fla_dhu_call.get(key) for key in flames}
    assert dhu_call["dv"] == f"{dv_local}#0[0]"
    flame_dhu = "chunk_bwd_dhu_triton#0"

    def renamed(value):  # FLA's dh recurrence's outputs are flame's kernel's in flame's backward
        return value.replace(f"{dhu}#0", flame_dhu) if isinstance(value, str) else value

    rest = [
        (name, {key: renamed(value) for key, value in call.items()}) for name, call in fla_sequence[at + 2 :]
    ]
    before = fla_sequence[:at] if forms_dv else fla_sequence[: at + 1]
    dhu_call = {**dhu_call, "dv": None} if forms_dv else dhu_call
    assert sequence == [*before, ("chunk_bwd_dhu_triton", dhu_call), *rest]
    assert named(ours, names) == [renamed(value) for value in named(theirs, fla_names)]


def test_flames_dh_recurrence_forms_dv_for_the_heads_where_that_was_faster():
    """forms_local_dv follows its H100 measurements: formed at K 128 x V 128 (and smaller heads), not at 16x96x192
    or the 340M model's 256 x 512."""
    heads = [(64, 64), (128, 128), (96, 192), (256, 512)]
    formed = [dhu_triton.forms_local_dv(torch.empty(1, 1, 1, k), torch.empty(1, 1, 1, v)) for k, v in heads]
    assert formed == [True, True, False, False]


def delta_forward_result(a):  # _delta_forward's (o, A, final state, w, h, v_new)
    batch = a["v"].shape[0]
    states = batch if a["cu_seqlens"] is None else len(a["cu_seqlens"]) - 1
    w, u = w_u(a)
    return (torch.empty_like(a["v"]), a["k"].new_empty(batch, T, H, a["chunk_size"]),
            f32(states, H, K, V) if a["output_final_state"] else None, w,
            a["k"].new_empty(batch, chunks(a), H, K, V), u)  # fmt: skip


def delta_backward_result(a):  # _delta_backward's (dq, dk, dv, dbeta, dh0)
    h0 = a["initial_state"]
    return (
        *(torch.empty_like(a[name]) for name in ("q", "k", "v", "beta")),
        None if h0 is None else f32(*h0.shape),
    )


@pytest.fixture
def delta_calls(fla_calls, monkeypatch):
    """fla_calls, with flame's composition of the delta rule's kernels (fla_library._delta_forward and
    _delta_backward, compared with FLA's own above) recorded instead of run: what the custom ops hand it."""
    compositions = {(fla_library, "_delta_forward"): delta_forward_result,
                    (fla_library, "_delta_backward"): delta_backward_result}  # fmt: skip
    patch_with_recorders(monkeypatch, compositions, fla_calls)
    return fla_calls


@pytest.mark.parametrize("save_states", [True, False], ids=["save", "recompute"])
@pytest.mark.parametrize("case", list(DELTA_CASES))
def test_delta_rule_forward_op_passes_what_fla_function_passes(case, save_states, delta_calls):
    layer = DELTA_CASES[case]
    a = delta_arguments(layer, save_states)
    o, state, q_normed, q_rstd, k_normed, k_rstd, A, w, h, v_new = DELTA_FWD._init_fn(**a)
    l2norm = delta_calls["l2norm_fwd"]
    assert same([x["x"] for x, _ in l2norm], [a["q"], a["k"]] if layer else [])
    ((call, (fla_o, fla_A, fla_state, fla_w, fla_h, fla_v_new)),) = delta_calls["_delta_forward"]
    # the normalised q, k reach the delta rule; the rest as given
    assert same([call["q"], call["k"]], [l2norm[0][1][0], l2norm[1][1][0]] if layer else [a["q"], a["k"]])
    names = ("v", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens", "chunk_size")
    assert same([call[name] for name in names], [a[name] for name in names])
    indices = delta_calls["prepare_chunk_indices"]
    assert call["chunk_indices"] is (indices[0][1] if layer else None)

    assert (o.shape, o.dtype) == (fla_o.shape, a["q"].dtype) and A is fla_A
    optional = [state, q_normed, q_rstd, k_normed, k_rstd]
    if layer:
        assert same(optional, [fla_state, *l2norm[0][1], *l2norm[1][1]])
    else:  # custom ops may not return their inputs: what would be q or k comes back empty, as does no state
        assert all(x.numel() == 0 for x in optional)
    # The state recurrence's results: kept for the backward when asked to, except for packed documents.
    if save_states and not layer:
        assert same([w, h, v_new], [fla_w, fla_h, fla_v_new])
    else:
        assert all(x.numel() == 0 for x in (w, h, v_new))


@pytest.mark.parametrize("save_states", [True, False], ids=["save", "recompute"])
@pytest.mark.parametrize("case", list(DELTA_CASES))
def test_delta_rule_backward_op_passes_what_fla_function_passes(case, save_states, delta_calls, monkeypatch):
    layer = DELTA_CASES[case]
    a = delta_arguments(layer, save_states)
    outputs, (do, dht, *_), op_grads, grads = delta_forward_backward(a, monkeypatch)
    _, _, q_normed, q_rstd, k_normed, k_rstd, A, w, h, v_new = outputs
    assert (dht is not None) == layer
    ((call, (fla_dq, fla_dk, *_)),) = delta_calls["_delta_backward"]
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
    indices = delta_calls["prepare_chunk_indices"][-1][1] if layer else None
    assert same(
        [call[name] for name in names],
        [a["v"], a["beta"], A, do, dht, indices, a["scale"], a["initial_state"], a["cu_seqlens"], CHUNK],
    )
    kept = save_states and not layer
    assert same([call[name] for name in ("w", "h", "v_new")], [w, h, v_new] if kept else [None] * 3)
    l2norm = [value for x, _ in delta_calls["l2norm_bwd"] for value in (x["y"], x["rstd"], x["dy"])]
    assert same(l2norm, [q_normed, q_rstd, fla_dq, k_normed, k_rstd, fla_dk] if layer else [])

    # gradients in the dtypes of the inputs, an absent one empty; autograd turns the empty one into None
    inputs = [a[name] for name in ("q", "k", "v", "beta", "initial_state")]
    check_like(op_grads[:4], inputs[:4])
    if layer:
        check_like(op_grads[4:], inputs[4:])
    else:
        assert op_grads[4].numel() == 0
    # autograd's gradients, one per input of the forward op
    assert same(grads, [*op_grads[:4], op_grads[4] if layer else None] + [None] * 7)


@pytest.mark.parametrize("save_states", [True, False], ids=["save", "recompute"])
@pytest.mark.parametrize("case", list(DELTA_CASES))
def test_delta_rule_fakes_agree_with_the_bodies(case, save_states, fla_calls, monkeypatch):
    a = delta_arguments(DELTA_CASES[case], save_states)
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
                       a["initial_state"], a["cu_seqlens"], a["cu_seqlens_cpu"], None, None, None, a["scale"],
                       False, CHUNK)  # fmt: skip
    received = [
        (f"{function}.{name}", value)
        for function, call, _ in fla_calls[SEQUENCE]
        for name, value in call.items()
        if isinstance(value, torch.Tensor)
    ]
    assert len(received) > 30
    assert [name for name, value in received if not value.is_contiguous()] == []


# The simple-GLA ops (Mamba-2's scan): FLA's chunk_local_cumsum, chunk_simple_gla_fwd and chunk_simple_gla_bwd
# replaced by PyTorch code computing what their Triton kernels compute (a chunk-local cumulative log decay in base 2;
# the backward's dg with respect to the natural-log cumulative decay, which the op sums back over each chunk), so that
# the op bodies and their autograd wiring can be compared on the CPU with the token-by-token scan.
def chunk_local_cumsum_in_pytorch(g, chunk_size, reverse=False, scale=None, **_):
    batch, length, heads = g.shape
    chunks = g.new_zeros(batch, -(-length // chunk_size) * chunk_size, heads)
    chunks[:, :length] = g
    chunks = chunks.unflatten(1, (-1, chunk_size))
    summed = chunks.flip(2).cumsum(2).flip(2) if reverse else chunks.cumsum(2)
    return (summed * (scale or 1.0)).flatten(1, 2)[:, :length].float()


def simple_gla_in_pytorch(q, k, v, g, scale, chunk_size, state_v_first):
    """o and the final state from base-2 chunk-local cumulative decays g [B, T, H], chunk by chunk."""
    batch, length, heads, key_dim = k.shape
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float64)
    outputs = []
    for start in range(0, length, chunk_size):
        qc, kc, vc, gc = (t[:, start : start + chunk_size].double() for t in (q, k, v, g))
        decay = torch.exp2(gc)  # [B, L, H]
        causal = torch.ones(gc.shape[1], gc.shape[1], dtype=torch.bool).tril()
        gaps = (gc[:, :, None] - gc[:, None, :]).permute(0, 3, 1, 2)  # [B, H, L, S]
        gaps = torch.exp2(gaps.masked_fill(~causal, float("-inf")))
        scores = torch.einsum("blhk,bshk->bhls", qc, kc) * gaps
        inner = torch.einsum("bhls,bshv->blhv", scores, vc)
        outputs.append(scale * (torch.einsum("blhk,bhkv->blhv", qc * decay[..., None], state) + inner))
        to_end = torch.exp2(gc[:, -1:] - gc)
        state = state * torch.exp2(gc[:, -1])[..., None, None] + torch.einsum(
            "bshk,bsh,bshv->bhkv", kc, to_end, vc
        )
    final = state.transpose(-1, -2) if state_v_first else state
    return torch.cat(outputs, 1).to(q.dtype), final.float()


def patch_simple_gla_in_pytorch(monkeypatch):
    import fla.ops.simple_gla.chunk as fla_simple_gla

    def forward(
        q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, chunk_size, **_
    ):
        assert g_gamma is None and initial_state is None and output_final_state
        return simple_gla_in_pytorch(q, k, v, g, scale, chunk_size, state_v_first)

    def backward(q, k, v, g, g_gamma, initial_state, do, dht, scale, state_v_first, chunk_size, **_):
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v, g)]
        o, final = simple_gla_in_pytorch(*leaves, scale, chunk_size, state_v_first)
        total = (o * do.double()).sum() + (0 if dht is None else (final * dht).sum())
        dq, dk, dv, dg = torch.autograd.grad(total, leaves)
        log2 = torch.log(torch.tensor(2.0, dtype=torch.float64))
        return dq, dk, dv, (dg / log2).float(), None  # dg with respect to the natural-log decay

    monkeypatch.setattr(fla_simple_gla, "chunk_local_cumsum", chunk_local_cumsum_in_pytorch)
    monkeypatch.setattr(fla_simple_gla, "chunk_simple_gla_fwd", forward)
    monkeypatch.setattr(fla_simple_gla, "chunk_simple_gla_bwd", backward)
    monkeypatch.setattr(flame.ops.gated_delta_rule.dqkwg_triton, "serve_where_fla_refuses", lambda: None)


@pytest.mark.parametrize("final_state_gradient", [False, True], ids=["output-only", "with-state"])
def test_simple_gla_ops_give_the_token_by_token_scan_and_its_gradients(final_state_gradient, monkeypatch):
    """The forward op's body, autograd's setup_context and backward with the backward op's body, on FLA's kernels'
    computations in PyTorch: y, the final state and every input's gradient equal the float64 token-by-token scan's
    (flame.ops.ssd.naive) over 150 tokens (chunks of 64 and a partial one) within 1e-5 of each tensor's largest
    value (float64 inputs; the cumulative log decay, the final state and the decay's gradient are float32, as FLA's);
    the fakes give the bodies' shapes and dtypes. A missing base-2 scale, a forward cumulative sum in the backward or a state in the wrong layout
    differs at order one."""
    from flame.ops.ssd import ssd_recurrent

    patch_simple_gla_in_pytorch(monkeypatch)
    forward_op, backward_op = fla_library.simple_gla_fwd, fla_library.simple_gla_bwd
    monkeypatch.setattr(fla_library, "simple_gla_bwd", backward_op._init_fn)
    torch.manual_seed(0)
    batch, length, heads, head_dim, state_size = 2, 150, 3, 5, 4
    x = torch.randn(batch, length, heads, head_dim, dtype=torch.float64)
    B, C = (torch.randn(batch, length, heads, state_size, dtype=torch.float64) for _ in range(2))
    log_decay = -torch.rand(batch, length, heads, dtype=torch.float64)
    do = torch.randn_like(x)
    dht = (
        torch.randn(batch, heads, head_dim, state_size, dtype=torch.float64) if final_state_gradient else None
    )

    leaves = [t.clone().requires_grad_() for t in (x, log_decay, B, C)]
    y, state = ssd_recurrent(leaves[0], None, leaves[1], leaves[2], leaves[3])
    total = (y * do).sum() + (0 if dht is None else (state * dht).sum())
    expected = {"y": y, "state": state, **dict(zip("xgBC", torch.autograd.grad(total, leaves), strict=True))}

    args = (C, B, x, log_decay, 1.0, True, 64)
    outputs = forward_op._init_fn(*args)
    check_like(forward_op._abstract_fn(*args), outputs)
    ctx = SimpleNamespace(mark_non_differentiable=lambda *_: None, set_materialize_grads=lambda _: None)
    ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
    fla_library._simple_gla_setup_context(ctx, args, outputs)
    dht_arg = None if dht is None else dht.float()
    backward_arguments = (do, dht_arg, *ctx.saved_tensors, *ctx.flags)
    check_like(backward_op._abstract_fn(*backward_arguments), backward_op._init_fn(*backward_arguments))
    dC, dB, dx, dg, *rest = fla_library._simple_gla_autograd_backward(ctx, do, dht_arg, None)
    assert rest == [None, None, None] and dg.dtype == log_decay.dtype
    ours = {"y": outputs[0], "state": outputs[1], "x": dx, "g": dg, "B": dB, "C": dC}
    for name, value in expected.items():
        assert (ours[name].double() - value).abs().max() <= 1e-5 * value.abs().max(), name
