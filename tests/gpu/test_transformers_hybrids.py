"""transformers' Gated DeltaNet hybrids (qwen3_next, olmo_hybrid) built by flame: compiled, their layers' chunk op is
flame's (flame.compat.transformers_gated_delta_rule_on_flame), while the eager model's calls stay on transformers'
hook to FLA's op. Both run in float32 and are measured against the same model in float64 on the CPU (flame's op there
is the float64 reference): for the logits and every gradient, the compiled model's relative RMS error is at most 3x
the eager model's, or 2e-3. A wiring bug (a wrong flag, a saved tensor mixed up) gives errors of order one.

The two float32 paths need not run the same backward kernels (each picks its own backend on Hopper), so they are
not compared with each other: on an H200 (2026-11-29) they differed by up to 1.3e-3 for olmo_hybrid and by 1.8e-2
to 4.7e-2 in qwen3_next's A_log and dt_bias gradients, sums over every token of the gate's gradient."""

import copy

import pytest
import torch
import transformers

import flame.ops.gated_delta_rule
from flame.models.generic.model import causal_lm_class, instantiate
from flame.train.kernels import prepare_gpu_kernels

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
def test_compiled_hybrid_runs_flames_op_and_is_as_accurate_as_eager(model_type, monkeypatch):
    prepare_gpu_kernels(torch.device("cuda"))
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    torch.manual_seed(0)
    model = instantiate(causal_lm_class(config), config).cuda()
    reference = copy.deepcopy(model).double().cpu()
    if model_type == "qwen3_next":
        reference.set_experts_implementation("eager")  # grouped_mm takes no float64
    tokens = torch.randint(0, 256, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    expected = logits_and_gradients(reference, reference, tokens.cpu())

    calls = []
    op = flame.ops.gated_delta_rule.chunk_gated_delta_rule

    def counted(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return op(*args, **kwargs)

    monkeypatch.setattr(flame.ops.gated_delta_rule, "chunk_gated_delta_rule", counted)
    eager = logits_and_gradients(model, model, tokens)
    assert calls == []  # eager: transformers' hook, FLA's op
    compiled = logits_and_gradients(model, torch.compile(model), tokens)
    assert calls and all(calls)  # compiled: flame's op, traced into the graph
    assert list(expected) == list(eager) == list(compiled) and len(expected) > 1
    failures = {}
    for name, exact in expected.items():
        eager_error, compiled_error = (relative_rms(result[name], exact) for result in (eager, compiled))
        if compiled_error > max(3 * eager_error, 2e-3):
            failures[name] = (compiled_error, eager_error)
    assert not failures, f"relative RMS errors against float64 (compiled, eager): {failures}"


def logits_and_gradients(model, module, tokens) -> dict[str, torch.Tensor]:
    model.zero_grad()
    logits = module(tokens)
    logits.to(torch.promote_types(logits.dtype, torch.float32)).logsumexp(-1).mean().backward()
    results = {"logits": logits}
    results.update((name, p.grad) for name, p in model.named_parameters() if p.grad is not None)
    return {name: tensor.detach().double().cpu() for name, tensor in results.items()}


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).square().mean().sqrt() / expected.square().mean().sqrt()).item()
