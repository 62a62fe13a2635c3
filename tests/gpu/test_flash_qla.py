"""FlashQLA as the gated delta rule's CUDA backend (flame/ops/gated_delta_rule/flash_qla.py) against flame's float32
PyTorch path, with the limits of tests/gpu/test_linear_attention_ops.py: outputs, final states and every input
gradient, dense and packed, plus the call flame's layer makes (gate and beta sigmoid computed before FlashQLA).
Under torch.compile FlashQLA runs as flame's custom ops: opcheck, their equality with FlashQLA's own autograd
Function, and a compiled layer in one graph against eager. Runs where flash-qla and tilelang are installed
(shared/gpu/pack-tilelang.sh); with them installed, test_linear_attention_ops.py's K = V = 128 cases reach FlashQLA
as well."""

import pytest
import torch

from flame.ops import dispatch
from flame.ops.gated_delta_rule import chunk_gated_delta_rule
from flame.ops.gated_delta_rule.flash_qla import CAPABILITIES, device_capability
from tests.gpu.test_linear_attention_ops import check_all, err_ratio, make_inputs, run

pytest.importorskip("flash_qla")
pytest.importorskip("tilelang")
if device_capability(torch.device("cuda")) not in CAPABILITIES:
    pytest.skip("FlashQLA runs on SM90, SM100 and SM103 GPUs", allow_module_level=True)


@pytest.fixture(autouse=True)
def flash_qla_pinned():
    dispatch.pin("chunk_gated_delta_rule", "flash_qla")
    yield
    dispatch.pin("chunk_gated_delta_rule", None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_v_heads", "lengths"), [(2, 2, (500,)), (2, 4, (100, 300, 129, 48))]
)
def test_flash_qla_matches_torch(num_heads, num_v_heads, lengths, dtype):
    q, k, v, g, beta, h0, cu = make_inputs(True, 128, num_heads, num_v_heads, lengths, False)
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    outputs = run(chunk_gated_delta_rule, q, k, v, g, beta, h0, cu, do, dht, dtype, dtype, "cuda")
    reference = run(chunk_gated_delta_rule, q, k, v, g, beta, h0, cu, do, dht, dtype, torch.float32, "cpu")
    check_all(f"flash_qla H{num_heads} HV{num_v_heads} {lengths}", dtype, outputs, reference)


def test_the_layers_call_matches_torch():
    """Gate and beta sigmoid requested in the kernel and value-first states, as flame's Gated DeltaNet layer calls
    it, bfloat16: FlashQLA gets them computed before the call; the gradients reach a, b, A_log and dt_bias."""
    torch.manual_seed(0)
    shapes = {
        "q": (2, 333, 2, 128),
        "k": (2, 333, 2, 128),
        "v": (2, 333, 4, 128),
        "a": (2, 333, 4),
        "b": (2, 333, 4),
    }
    leaves = {name: torch.randn(shape).bfloat16().float() for name, shape in shapes.items()}
    leaves["A_log"], leaves["dt_bias"] = torch.rand(4) * 2, torch.randn(4)
    do = torch.randn(2, 333, 4, 128)

    def call(device, dtype):
        x = {
            n: t.to(device, dtype if n in shapes else torch.float32).requires_grad_()
            for n, t in leaves.items()
        }
        o, _ = chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["a"], x["b"], use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            state_v_first=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
        )  # fmt: skip
        (o.float() * do.to(device)).sum().backward()
        return {"o": o.detach().cpu(), **{f"d{n}": t.grad.cpu() for n, t in x.items()}}

    got, want = call("cuda", torch.bfloat16), call("cpu", torch.float32)
    limits = {
        "o": 0.01,
        "dq": 0.016,
        "dk": 0.016,
        "dv": 0.016,
        "da": 0.04,
        "db": 0.04,
        "dA_log": 0.04,
        "ddt_bias": 0.04,
    }
    ratios = {name: err_ratio(want[name], got[name]) for name in limits}
    print("flash_qla layer call bfloat16: " + " ".join(f"{n} {r:.5f}/{limits[n]}" for n, r in ratios.items()))
    for name, limit in limits.items():
        assert ratios[name] < limit, f"{name}: relative RMS error {ratios[name]:.5f} >= {limit}"


def test_the_custom_ops_pass_opcheck_and_equal_flash_qlas_function():
    """Under torch.compile FlashQLA runs as flame's custom ops (flash_qla.gated_delta_rule_fwd / _bwd): opcheck
    (schema, fakes against the real outputs, autograd, AOTAutograd tracing), then outputs and gradients against
    FlashQLA's own autograd Function on the same inputs (the same kernels: relative RMS difference <= 1e-3; the
    custom ops recompute the context-parallel partitioning the Function caches)."""
    from flame.ops.gated_delta_rule import flash_qla as backend

    torch.manual_seed(0)
    lengths = (300, 129, 48)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()

    q, k, v = leaf(1, 477, 2, 128), leaf(1, 477, 2, 128), leaf(1, 477, 4, 128)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 477, 4, device="cuda")).requires_grad_()
    beta = torch.rand(1, 477, 4, device="cuda", dtype=torch.bfloat16).requires_grad_()
    h0 = leaf(3, 4, 128, 128, dtype=torch.float32)
    flags = (128**-0.5, True, True, True)  # scale, output_final_state, l2norm, state_v_first
    torch.library.opcheck(backend.gated_delta_rule_fwd, (q, k, v, g, beta, h0, cu_seqlens, *flags),
                          rtol=1e-2, atol=1e-2)  # fmt: skip

    def outputs_and_grads(call):
        for x in (q, k, v, g, beta, h0):
            x.grad = None
        o, ht = call()
        torch.manual_seed(1)
        (
            (o.float() * torch.randn_like(o, dtype=torch.float32)).sum() + (ht * torch.randn_like(ht)).sum()
        ).backward()
        return [o.detach(), ht.detach()] + [x.grad.clone() for x in (q, k, v, g, beta, h0)]

    ours = outputs_and_grads(
        lambda: backend.gated_delta_rule_fwd(q, k, v, g, beta, h0, cu_seqlens, *flags)[:2]
    )
    import flash_qla

    theirs = outputs_and_grads(lambda: flash_qla.chunk_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, scale=flags[0], initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, state_v_first=True, auto_cp=True))  # fmt: skip
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        error = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()
        assert error <= 1e-3, f"output {index}: relative RMS difference {error:.2e}"


def test_a_compiled_layer_on_flash_qla_is_one_graph_and_matches_eager():
    from flame.models.layers.gated_deltanet import GatedDeltaNet
    from tests.gpu.test_fla_library import check_compiled_layer_is_one_graph

    torch.manual_seed(0)
    check_compiled_layer_is_one_graph(
        GatedDeltaNet(hidden_size=256, head_dim=128, num_heads=2, num_v_heads=4, expand_v=1.0).cuda()
    )
