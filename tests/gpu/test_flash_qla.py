"""FlashQLA as the gated delta rule's CUDA backend (flame/ops/gated_delta_rule/flash_qla.py) against flame's float32
PyTorch path, with the limits of tests/gpu/test_linear_attention_ops.py: outputs, final states and every input
gradient, dense and packed, plus the call flame's layer makes (gate and beta sigmoid computed before FlashQLA).
Runs where flash-qla and tilelang are installed (shared/gpu/pack-tilelang.sh); with them installed,
test_linear_attention_ops.py's K = V = 128 cases reach FlashQLA as well."""

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
