"""flame's HF classes on the GPU (FLA's kernels, bfloat16, as flame.eval runs them there): a Gated DeltaNet model
and a hybrid score lambada-style loglikelihoods in a padded batch of 16 as they do one at a time.

Right padding without a mask, as lm-eval batches loglikelihood requests: within 1e-3 per example (each row's real
tokens go through the same kernels on the same chunk grid as alone). Left padding with a mask
(flame/models/layers/decoding.py: gates computed outside FLA's kernel) shifts every row's chunk grid, so bfloat16
rounds differently: there the difference must stay within twice the model's own bfloat16 error (batch of 1, bfloat16
on the GPU against float32 PyTorch on the CPU) and within 1e-3 of the loglikelihood's magnitude; a padding bug moves
scores by whole nats."""

import pytest
import torch

from tests.hf.test_cache_and_padding import flame_hf_model, padded

LIMIT = 1e-3
GDN = {"hidden_size": 256, "num_hidden_layers": 4, "num_heads": 4, "head_dim": 64}
CASES = {
    "gated_deltanet": GDN,
    "gdn-hybrid": {**GDN, "attn": {"layers": [2], "num_heads": 4}},
}
CONTINUATION = 5  # tokens scored per example, after the context


def loglikelihoods(logits: torch.Tensor, ids: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """Per row, the summed log-probability of the CONTINUATION tokens that end at ends[row] (float32)."""
    scores = []
    for row, end in enumerate(ends):
        logprobs = torch.log_softmax(logits[row, end - CONTINUATION - 1 : end - 1].float(), dim=-1)
        scores.append(logprobs.gather(-1, ids[row, end - CONTINUATION : end, None]).sum())
    return torch.stack(scores)


def one_at_a_time(model, rows: list[torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.stack(
        [
            loglikelihoods(model(row[None].to(device)).logits, row[None].to(device), [len(row)])[0].cpu()
            for row in rows
        ]
    )


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("case", list(CASES))
def test_batch_of_16_scores_like_batch_of_1(case, side):
    model = flame_hf_model("gated_deltanet", **CASES[case])
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 300, (16,), generator=generator).tolist()
    rows = [torch.randint(0, 4096, (n,), generator=generator) for n in lengths]
    ids, mask = padded(rows, side)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        exact = one_at_a_time(model, rows)  # float32, flame's PyTorch ops on the CPU
        model.to("cuda", torch.bfloat16)
        alone = one_at_a_time(model, rows)
        # lm-eval sends right-padded loglikelihood batches without a mask (a causal model never reads them).
        logits = model(ids, attention_mask=mask if side == "left" else None).logits
    ends = [ids.shape[1] if side == "left" else n for n in lengths]
    batch = loglikelihoods(logits, ids, ends).cpu()
    difference = (batch - alone).abs().max().item()
    bf16_error = (alone - exact).abs().max().item()
    print(
        f"{case} {side}: max |batch 16 - batch 1| = {difference:.2e}, bfloat16 error of batch 1 {bf16_error:.2e} "
        f"(loglikelihoods ~{alone.mean():.1f})"
    )
    if side == "right":
        assert difference <= LIMIT
    else:
        assert difference <= min(2 * bf16_error, LIMIT * exact.abs().max().item())
