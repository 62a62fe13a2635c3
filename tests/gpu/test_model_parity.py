"""Every model family on the GPU path (FLA's Triton kernels / SDPA, bf16 autocast) against the PyTorch path
(CPU, float32) with the same weights: logits and every parameter gradient.

Limits on the relative error ||x - ref|| / ||ref||: 0.02 for logits and 0.05 for each parameter's gradient (bf16
autocast through two layers; FLA's own op tests allow 0.005-0.02 per op in float16). Softpick and rectified
softmax are not smooth at a score of 0 (rectified is not even continuous there), so bf16 rounding of q and k moves
scores across it: their limits are 0.15 for gradients, and 0.06 for rectified logits. Their GPU path is still the
materialized PyTorch one (no fused kernel yet); the comparison is then bf16 on GPU against float32 on CPU.
A gradient far smaller than the model's largest (e.g. the one-element A_log of a single-head layer, a sum of
terms that nearly cancel) is judged against 1% of the largest gradient norm instead of its own norm: bf16 alone
(the PyTorch path under CPU autocast) moves such a gradient by 16% relative while the error stays 1e-4 absolute.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from flame.models import build_model, get_model_spec

LOGIT_LIMIT, GRAD_LIMIT = 0.02, 0.05
NON_SMOOTH_LIMITS = {"softpick": (0.02, 0.15), "scaled-softpick": (0.02, 0.15), "rectified": (0.06, 0.15)}
VOCAB = 512
TRANSFORMER = dict(model_type="transformer", hidden_size=128, num_hidden_layers=2, num_heads=4, num_kv_heads=2,
                   vocab_size=VOCAB, qk_norm=True)  # fmt: skip
GDN = dict(model_type="gated_deltanet", hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64,
           expand_v=2, vocab_size=VOCAB)  # fmt: skip
FAMILIES = {
    "transformer": TRANSFORMER,
    "transformer-window": {**TRANSFORMER, "window_size": 48},
    "softpick": {**TRANSFORMER, "attn_impl": "parallel_softpick_attn"},
    "rectified": {**TRANSFORMER, "attn_impl": "parallel_rectified_attn"},
    "scaled-softpick": {**TRANSFORMER, "attn_impl": "parallel_scaled_softpick_attn"},
    "gated_deltanet": GDN,
    "gated_deltanet++": {**GDN, "allow_neg_eigval": True},
    "gated_deltanet-gva": {**GDN, "num_v_heads": 4, "expand_v": 1},
    "gated_deltanet-nogate": {**GDN, "use_gate": False, "head_dim": 128, "num_heads": 1},
    "delta_net": dict(
        model_type="delta_net", hidden_size=128, num_hidden_layers=2, num_heads=2, vocab_size=VOCAB
    ),
    "hybrid": {**GDN, "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qk_norm": True}},
}


def err_ratio(ref: torch.Tensor, out: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor)."""
    ref, out = ref.double(), out.double()
    return ((ref - out).norm() / max(ref.norm().item(), floor, 1e-12)).item()


def forward_backward(model, tokens, labels, position_ids, cu_seqlens, autocast: bool):
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens.to(device), position_ids=position_ids.to(device),
                       cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device))  # fmt: skip
    F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten()).backward()
    return logits.float().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_path_matches_pytorch_path(family, varlen):
    config = FAMILIES[family]
    args, _ = get_model_spec(config["model_type"]).args_cls.from_dict(config)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    gpu_model = copy.deepcopy(model).cuda()
    if varlen:
        lengths = [37, 150, 1, 68]
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        tokens = torch.randint(0, VOCAB, (1, sum(lengths)))
    else:
        cu_seqlens = None
        position_ids = torch.arange(203).expand(2, -1)
        tokens = torch.randint(0, VOCAB, (2, 203))
    labels = torch.randint(0, VOCAB, tokens.shape)

    ref_logits, ref_grads = forward_backward(model, tokens, labels, position_ids, cu_seqlens, autocast=False)
    logits, grads = forward_backward(gpu_model, tokens, labels, position_ids, cu_seqlens, autocast=True)

    ratios = {"logits": err_ratio(ref_logits, logits)}
    floor = 0.01 * max(g.norm().item() for g in ref_grads.values())
    ratios.update({name: err_ratio(ref_grads[name], grads[name], floor) for name in ref_grads})
    worst = max((r, n) for n, r in ratios.items() if n != "logits")
    print(f"{family:>22} {'varlen' if varlen else 'batch':>6}: logits {ratios['logits']:.5f}, "
          f"worst grad {worst[0]:.5f} ({worst[1]}), {len(ref_grads)} parameters")  # fmt: skip
    logit_limit, grad_limit = NON_SMOOTH_LIMITS.get(family, (LOGIT_LIMIT, GRAD_LIMIT))
    assert torch.isfinite(logits).all()
    for name, ratio in ratios.items():
        assert name == "logits" or torch.isfinite(grads[name]).all(), name
        assert ratio < (logit_limit if name == "logits" else grad_limit), f"{name}: {ratio:.5f}"
