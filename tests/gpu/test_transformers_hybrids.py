"""transformers' Gated DeltaNet hybrids (qwen3_next, olmo_hybrid) built by flame: compiled, their layers' chunk op is
flame's (flame.compat.transformers_gated_delta_rule_on_flame), and the compiled model matches the eager one, whose
calls stay on transformers' hook to FLA's op: the same FLA kernels on both sides, in float32, so the logits and every
gradient agree to a relative RMS error of 1e-3 (a wiring bug, a wrong flag or saved tensor, gives errors of order
one). Under bf16 autocast the two differed by more than 1e-2 in their first tensors over that bound (1.1e-2 for
olmo_hybrid, 1.4e-2 for qwen3_next, H200, 2026-11-28): bf16 rounding of the intermediates, which inductor fuses in
float32, compounded over the blocks and, in qwen3_next, the experts each token is routed to."""

import pytest
import torch
import transformers

import flame.ops.gated_delta_rule
from flame.models.generic.model import causal_lm_class, instantiate
from flame.train.model_parts import prepare_gpu_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIGS = {
    "qwen3_next": dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32,
    ),
    "olmo_hybrid": dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_allow_neg_eigval=True, pad_token_id=None, bos_token_id=None, eos_token_id=1,
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_compiled_hybrid_runs_flames_op_and_matches_eager(model_type, monkeypatch):
    prepare_gpu_kernels(torch.device("cuda"))
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    torch.manual_seed(0)
    model = instantiate(causal_lm_class(config), config).cuda()
    calls = []
    op = flame.ops.gated_delta_rule.chunk_gated_delta_rule

    def counted(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return op(*args, **kwargs)

    monkeypatch.setattr(flame.ops.gated_delta_rule, "chunk_gated_delta_rule", counted)
    tokens = torch.randint(0, 256, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = []
    for module in (model, torch.compile(model)):
        model.zero_grad()
        logits = module(tokens)
        logits.float().logsumexp(-1).mean().backward()
        results.append([logits.float()] + [p.grad for p in model.parameters() if p.grad is not None])
        if module is model:
            assert calls == []  # eager: transformers' hook, FLA's op
    assert calls and all(calls)  # compiled: flame's op, traced into the graph
    assert len(results[0]) == len(results[1]) > 1
    errors = [
        ((compiled - eager).square().mean().sqrt() / eager.square().mean().sqrt()).item()
        for eager, compiled in zip(*results, strict=True)
    ]
    assert max(errors) <= 1e-3, f"relative RMS errors (logits, then the gradients): {errors}"
