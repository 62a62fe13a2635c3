"""FLA families whose backward calls FLA's gated chunk_bwd_dqkwg, which FLA 0.6.0 refuses on Hopper with Triton
3.4-3.7.0 (FLA issue 640): flame's generic path serves it with flame's kernel (flame.compat). Here Comba's chunked
op (FLA's Triton kernels, with flame's dqkwg where FLA refuses its own) against FLA's own PyTorch recurrence, in
float32 on the same bfloat16-rounded inputs: output, final state and every input gradient, within twice FLA's
float16 test ratios (relative RMS error), as tests/gpu/test_linear_attention_ops.py does for Gated DeltaNet."""

import pytest
import torch
import torch.nn.functional as F

from flame.ops.gated_delta_rule.dqkwg_triton import serve_where_fla_refuses
from tests.gpu.test_linear_attention_ops import DTYPE_FACTOR, RATIOS, err_ratio

LIMITS = {
    "o": RATIOS["o"],
    "ht": RATIOS["ht"],
    **{f"d{n}": 0.02 for n in ("q", "k", "v", "p", "g", "beta", "h0")},
}


@pytest.mark.parametrize("seq_len", [300, 1000])
def test_comba_chunk_backward_matches_fla_recurrence(seq_len):
    from fla.ops.comba import chunk_comba
    from fla.ops.comba.naive import naive_recurrent_comba

    serve_where_fla_refuses()
    torch.manual_seed(0)
    B, H, K, V, dtype = 2, 3, 64, 96, torch.bfloat16
    q = torch.randn(B, seq_len, H, K, device="cuda", dtype=dtype)
    k = F.normalize(torch.randn(B, seq_len, H, K, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(B, seq_len, H, V, device="cuda", dtype=dtype)
    p = (k.float() * torch.rand(H, device="cuda")[:, None].sigmoid()).to(dtype)
    g = F.logsigmoid(torch.randn(B, seq_len, H, device="cuda")).to(dtype)
    beta = torch.rand(B, seq_len, H, device="cuda").sigmoid().to(dtype)
    h0 = torch.randn(B, H, K, V, device="cuda", dtype=torch.float32)
    inputs = {"q": q, "k": k, "v": v, "p": p, "g": g, "beta": beta, "h0": h0}
    do = torch.randn(B, seq_len, H, V, device="cuda")
    dht = torch.randn(B, H, K, V, device="cuda")

    def run(fn, cast):
        leaves = {n: t.detach().to(cast(t)).requires_grad_() for n, t in inputs.items()}
        o, ht = fn(leaves)
        ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
        return {"o": o.detach(), "ht": ht.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}

    ours = run(
        lambda t: chunk_comba(
            t["q"], t["k"], t["v"], t["p"], t["g"], t["beta"], initial_state=t["h0"], output_final_state=True
        ),  # fmt: skip
        lambda t: t.dtype,
    )
    reference = run(
        lambda t: naive_recurrent_comba(
            t["q"], t["k"], t["v"], t["p"], t["beta"], t["g"], initial_state=t["h0"], output_final_state=True
        ),  # fmt: skip
        lambda t: torch.float32,
    )
    ratios = {name: err_ratio(reference[name], ours[name]) for name in LIMITS}
    print(f"comba T={seq_len}: " + " ".join(f"{n} {r:.5f}" for n, r in ratios.items()))
    for name, limit in LIMITS.items():
        assert torch.isfinite(ours[name]).all(), name
        assert ratios[name] < limit * DTYPE_FACTOR[dtype], f"{name}: {ratios[name]:.5f}"
