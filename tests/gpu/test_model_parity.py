"""Every model family on the GPU path (FLA's and flame's Triton kernels / SDPA, bf16 autocast) against the PyTorch
path (CPU, float32) with the same weights: logits and every parameter gradient.

Limits on the relative error ||x - ref|| / ||ref||: 0.02 for logits and 0.05 for each parameter's gradient (bf16
autocast through two layers; FLA's own op tests allow 0.005-0.02 per op in float16). Softpick and rectified
softmax are not smooth at a score of 0 (rectified is not even continuous there), so bf16 rounding of q and k moves
scores across it. The first token of a document sees one key, and softpick of one score s is
relu(e^s - 1) / |e^s - 1|, a step: a token's output flips between 0 and v when rounding flips the sign of s. On
an H100 and an H200 (2026-11-21) softpick on packed documents measured logits 0.027 in bf16 (0.41 at the first
token of the second document, 0.013 or less at every other token) and 0.00000 in float32. So the softpick family
gets 0.06 for logits and 0.15 for gradients in bf16, and is also compared in float32 on the GPU (no autocast),
where its kernel must agree to 1e-4: that comparison is the one that would show a kernel bug.
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
NON_SMOOTH_LIMITS = dict.fromkeys(("softpick", "scaled-softpick", "rectified"), (0.06, 0.15))
FLOAT32_LIMIT = 1e-4
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


def relative_errors(family: str, varlen: bool, autocast: bool) -> dict[str, float]:
    """{"logits": ratio, parameter name: ratio} of the GPU path against the float32 PyTorch path on the CPU."""
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
    logits, grads = forward_backward(gpu_model, tokens, labels, position_ids, cu_seqlens, autocast=autocast)
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(grad).all() for grad in grads.values())

    ratios = {"logits": err_ratio(ref_logits, logits)}
    floor = 0.01 * max(g.norm().item() for g in ref_grads.values())
    ratios.update({name: err_ratio(ref_grads[name], grads[name], floor) for name in ref_grads})
    worst = max((r, n) for n, r in ratios.items() if n != "logits")
    print(f"{family:>22} {'varlen' if varlen else 'batch':>6} {'bf16' if autocast else 'fp32'}: logits "
          f"{ratios['logits']:.5f}, worst grad {worst[0]:.5f} ({worst[1]}), {len(ref_grads)} parameters")  # fmt: skip
    return ratios


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_path_matches_pytorch_path(family, varlen):
    logit_limit, grad_limit = NON_SMOOTH_LIMITS.get(family, (LOGIT_LIMIT, GRAD_LIMIT))
    for name, ratio in relative_errors(family, varlen, autocast=True).items():
        assert ratio < (logit_limit if name == "logits" else grad_limit), f"{name}: {ratio:.5f}"


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("family", list(NON_SMOOTH_LIMITS))
def test_softpick_family_gpu_path_matches_in_float32(family, varlen):
    for name, ratio in relative_errors(family, varlen, autocast=False).items():
        assert ratio < FLOAT32_LIMIT, f"{name}: {ratio:.2e}"
