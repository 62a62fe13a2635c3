"""FLA's chunk gated delta rule and chunk delta rule as torch.library custom ops (flame.ops.fla_library).

- torch.library.opcheck: schema, fake (shape-only) implementations against the real outputs, autograd
  registration, and tracing by AOTAutograd with dynamic shapes.
- The custom ops give the outputs and gradients of FLA's own autograd Functions: with FLA's recurrences the same
  Triton kernels run on the same inputs (relative RMS difference <= 1e-3, see SAME_KERNELS_LIMIT); with flame's
  state recurrence, its pass with the output and the dh recurrence, with the intra-chunk dv where it forms it
  (fwd_h_triton.py, fwd_o_triton.py, dhu_triton.py: what training runs for value-first states) within bf16
  rounding (FLAME_RECURRENCES_LIMIT).
- A compiled Gated DeltaNet or DeltaNet layer is one graph (fullgraph=True compiles) and matches the eager layer.
Eager training keeps FLA's own Functions (tested against the PyTorch reference in test_linear_attention_ops.py
and test_model_parity.py); the custom ops serve torch.compile, whose layer the last test compares with eager.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from flame.models.layers.delta_net import DeltaNet
from flame.models.layers.gated_deltanet import GatedDeltaNet
from flame.ops import fla_library
from flame.ops.gated_delta_rule import dhu_triton, fwd_h_triton, fwd_o_triton
from flame.ops.gated_delta_rule.chunk_recurrence import takes
from flame.ops.gated_delta_rule.dqkwg_triton import serve_where_fla_refuses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The custom ops and FLA's Functions run the same kernels: on an H100 (2026-11-21) they agreed bit for bit, and FLA
# with itself too (the test prints both). The limit leaves room for kernels that sum in another order on other GPUs
# or autotuning choices; a wiring bug (a wrong saved tensor, flag or dtype) gives errors of order one. opcheck
# compares eager and traced runs of the op with rtol = atol = 1e-2 for the same reason (one bf16 ulp is 0.4%
# relative). Its loss sums every output, so the gradient of the final state arrives expanded (stride 0): that
# check found the custom ops handing such a tensor to FLA's kernels, which read it as contiguous (now copied).
SAME_KERNELS_LIMIT = 1e-3
# flame's recurrences round h, v_new, dh and dv2 to bf16 as FLA's do, from float32 sums taken in another order: one
# bf16 rounding apart (0.4%) in those intermediates, which the outputs and gradients inherit.
FLAME_RECURRENCES_LIMIT = 1e-2

# (gate, beta sigmoid, l2norm, state_v_first and negative eigenvalues in the op, as the layer runs it; or none of
# them) x (packed documents or a batch)
GDN_CASES = {
    "layer-flags-varlen": dict(in_kernel=True, lengths=(37, 200, 63)),
    "layer-flags-batch": dict(in_kernel=True, lengths=(129,)),
    "plain-varlen": dict(in_kernel=False, lengths=(100, 29)),
    "plain-batch": dict(in_kernel=False, lengths=(77,)),
}


def gdn_inputs(in_kernel: bool, lengths, dtype=torch.bfloat16, heads=2, v_heads=4, head_dim=64):
    torch.manual_seed(0)
    varlen = len(lengths) > 1
    batch, seq_len = (1, sum(lengths)) if varlen else (2, lengths[0])
    num_states = len(lengths) if varlen else batch

    def leaf(*shape, dtype=dtype):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()

    q, k = leaf(batch, seq_len, heads, head_dim), leaf(batch, seq_len, heads, head_dim)
    if not in_kernel:  # the delta rule needs unit-norm keys: normalise them here instead of in the op
        q, k = (F.normalize(x.detach().float(), dim=-1).to(dtype).requires_grad_() for x in (q, k))
    v = leaf(batch, seq_len, v_heads, head_dim)
    if in_kernel:
        g, beta = leaf(batch, seq_len, v_heads), leaf(batch, seq_len, v_heads)
        A_log = torch.rand(v_heads, device="cuda").mul(3).requires_grad_()
        dt_bias = leaf(v_heads, dtype=torch.float32)
    else:
        g = F.logsigmoid(torch.randn(batch, seq_len, v_heads, device="cuda")).requires_grad_()
        beta = torch.rand(batch, seq_len, v_heads, device="cuda", dtype=dtype).requires_grad_()
        A_log = dt_bias = None
    h0 = leaf(num_states, v_heads, head_dim, head_dim, dtype=torch.float32)
    cu_seqlens = (
        torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda") if varlen else None
    )
    flags = dict(
        use_qk_l2norm_in_kernel=in_kernel,
        use_beta_sigmoid_in_kernel=in_kernel,
        allow_neg_eigval=in_kernel,
        state_v_first=in_kernel,
        use_gate_in_kernel=in_kernel,
    )
    return (q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens), flags


@pytest.fixture(params=fla_library.CHUNK_STATES)
def chunk_states(request):
    """Each way of a delta rule's backward to its chunk states: recomputed, or kept by the forward."""
    before = "save" if fla_library.saves_chunk_states() else "recompute"
    fla_library.set_chunk_states(request.param)
    yield request.param
    fla_library.set_chunk_states(before)


@pytest.fixture(params=["fla", "flame"])
def recurrences(request, monkeypatch):
    """The custom ops' state recurrence (alone or with the output in one pass) and dh recurrence: FLA's (the kernels
    of FLA's Functions) or flame's where they take the call (value-first states; the forward's kernels also at these
    tests' K 64, where training keeps FLA's, the faster there). Gives the limit on the relative RMS difference from
    FLA's Functions and the names of flame's kernels' calls."""
    calls = []
    kernels = {
        dhu_triton: "chunk_bwd_dhu_triton",
        fwd_h_triton: "chunk_fwd_h_triton",
        fwd_o_triton: "chunk_fwd_o_triton",
    }
    for module, name in kernels.items():
        if request.param == "fla":
            monkeypatch.setattr(module, "serves", lambda x, chunk_size, state_v_first: False)
            continue
        if module is not dhu_triton:
            monkeypatch.setattr(
                module, "serves", functools.partial(takes, fitting_configs=module.fitting_configs)
            )
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, kernel=kernel, name=name, **kw: calls.append(name) or kernel(*a, **kw)
        )
    return (SAME_KERNELS_LIMIT if request.param == "fla" else FLAME_RECURRENCES_LIMIT), calls


@pytest.mark.parametrize("case", list(GDN_CASES))
@pytest.mark.parametrize("save_states", [False, True], ids=["recompute", "save"])
def test_gated_delta_rule_ops_pass_opcheck(case, save_states):
    (q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens), flags = gdn_inputs(**GDN_CASES[case])
    args = (
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        h0,
        cu_seqlens,
        None,
        0.125,
        True,
        *flags.values(),
        64,
        save_states,
    )
    torch.library.opcheck(fla_library.gated_delta_rule_fwd, args, rtol=1e-2, atol=1e-2)


def outputs_and_grads(op, tensors, flags):
    q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens = tensors
    leaves = [x for x in (q, k, v, g, beta, A_log, dt_bias, h0) if x is not None]
    for x in leaves:
        x.grad = None
    o, ht = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
               A_log=A_log, dt_bias=dt_bias, **flags)  # fmt: skip
    torch.manual_seed(1)
    (
        (o.float() * torch.randn_like(o, dtype=torch.float32)).sum() + (ht * torch.randn_like(ht)).sum()
    ).backward()
    return [o.detach(), ht.detach()] + [x.grad.clone() for x in leaves]


def relative_rms(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference, value = reference.double(), value.double()
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("case", list(GDN_CASES))
def test_gated_delta_rule_ops_equal_fla_function(case, chunk_states, recurrences):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op

    limit, flame_calls = recurrences

    serve_where_fla_refuses()  # FLA's own backward needs flame's kernel on Hopper + Triton 3.6
    tensors, flags = gdn_inputs(**GDN_CASES[case])
    ours = outputs_and_grads(fla_library.chunk_gated_delta_rule, tensors, flags)
    theirs = outputs_and_grads(fla_op, tensors, flags)
    theirs_again = outputs_and_grads(fla_op, tensors, flags)
    for index, (a, b, c) in enumerate(zip(ours, theirs, theirs_again, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"output {index}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        print(
            f"{case}, {chunk_states}, output {index}: ours vs FLA {relative_rms(a, b):.2e}, "
            f"FLA vs FLA {relative_rms(c, b):.2e}"
        )
        assert torch.isfinite(a).all()
        assert relative_rms(a, b) <= limit, f"output {index}: {relative_rms(a, b):.2e}"
    # flame's kernels serve the value-first states of the layer's flags (and only those): in the forward the state
    # recurrence where it keeps its results (never for packed documents), else its pass with the output; the state
    # recurrence again in the backward unless the forward kept its results; then the dh recurrence
    served = limit == FLAME_RECURRENCES_LIMIT and flags["state_v_first"]
    kept = chunk_states == "save" and len(GDN_CASES[case]["lengths"]) == 1
    forward = ["chunk_fwd_h_triton"] if kept else ["chunk_fwd_o_triton", "chunk_fwd_h_triton"]
    expected = [*forward, "chunk_bwd_dhu_triton"] if served else []
    assert flame_calls == expected


def delta_inputs(in_kernel: bool, lengths, dtype=torch.bfloat16, heads=2, head_dim=64):
    """The plain delta rule's inputs: the gated case's without the gate, one head count for q, k and v."""
    (q, k, v, _, _, _, _, h0, cu_seqlens), _ = gdn_inputs(
        in_kernel, lengths, dtype, heads=heads, v_heads=heads, head_dim=head_dim
    )
    beta = torch.rand(*q.shape[:3], device="cuda", dtype=dtype).requires_grad_()
    return (q, k, v, beta, h0, cu_seqlens), dict(use_qk_l2norm_in_kernel=in_kernel)


@pytest.mark.parametrize("case", list(GDN_CASES))
@pytest.mark.parametrize("save_states", [False, True], ids=["recompute", "save"])
def test_delta_rule_ops_pass_opcheck(case, save_states):
    (q, k, v, beta, h0, cu_seqlens), flags = delta_inputs(**GDN_CASES[case])
    args = (
        q,
        k,
        v,
        beta,
        h0,
        cu_seqlens,
        None,
        0.125,
        True,
        flags["use_qk_l2norm_in_kernel"],
        64,
        save_states,
    )
    torch.library.opcheck(fla_library.delta_rule_fwd, args, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", list(GDN_CASES))
def test_delta_rule_ops_equal_fla_function(case, chunk_states):
    from fla.ops.delta_rule import chunk_delta_rule as fla_op

    (q, k, v, beta, h0, cu_seqlens), flags = delta_inputs(**GDN_CASES[case])

    def run(op):
        for x in (q, k, v, beta, h0):
            x.grad = None
        o, ht = op(q, k, v, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, **flags)
        torch.manual_seed(1)
        (
            (o.float() * torch.randn_like(o, dtype=torch.float32)).sum() + (ht * torch.randn_like(ht)).sum()
        ).backward()
        return [o.detach(), ht.detach()] + [x.grad.clone() for x in (q, k, v, beta, h0)]

    for index, (ours, theirs) in enumerate(zip(run(fla_library.chunk_delta_rule), run(fla_op), strict=True)):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, index
        assert torch.isfinite(ours).all()
        assert relative_rms(ours, theirs) <= SAME_KERNELS_LIMIT, (
            f"output {index}: {relative_rms(ours, theirs):.2e}"
        )


def test_compiled_deltanet_layer_is_one_graph_and_matches_eager(chunk_states):
    torch.manual_seed(0)
    check_compiled_layer_is_one_graph(DeltaNet(hidden_size=256, num_heads=4).cuda())


def test_compiled_gated_deltanet_layer_is_one_graph_and_matches_eager(chunk_states):
    torch.manual_seed(0)
    layer = GatedDeltaNet(
        hidden_size=256, head_dim=64, num_heads=2, num_v_heads=4, allow_neg_eigval=True
    ).cuda()
    check_compiled_layer_is_one_graph(layer)


def check_compiled_layer_is_one_graph(layer):
    x = torch.randn(1, 300, 256, device="cuda", requires_grad=True)
    position_ids = torch.arange(300, device="cuda")[None]
    cu_seqlens = torch.tensor([0, 50, 251, 300], device="cuda", dtype=torch.int32)
    compiled = torch.compile(layer, fullgraph=True)  # fails on any graph break

    results = []
    for module in (layer, compiled):
        x.grad = None
        layer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x, position_ids, cu_seqlens)
        y.float().square().sum().backward()
        results.append([y.float(), x.grad] + [p.grad for p in layer.parameters()])
    # Same kernels for the ops; the compiled norms and elementwise ops are inductor's, in float32: the
    # difference is bf16 rounding of intermediates, so compare on the relative RMS error.
    for eager_value, compiled_value in zip(*results, strict=True):
        error = (compiled_value - eager_value).float().square().mean().sqrt()
        scale = eager_value.float().square().mean().sqrt()
        assert error <= 1e-2 * scale, f"relative RMS error {(error / scale).item():.2e}"
