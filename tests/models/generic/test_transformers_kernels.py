"""transformers' classes built by flame use the kernels their own class chooses, or flame's where the class's choice
fails: the experts kernel of a mixture-of-experts class, and the Gated DeltaNet layers' chunk op (flame.compat)."""

import inspect
import types

import pytest
import torch
import transformers

from flame import compat
from flame.models.generic.model import causal_lm_class, instantiate

QWEN3_NEXT = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=12,
)  # fmt: skip
OLMO_HYBRID = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=12,
    linear_allow_neg_eigval=True, pad_token_id=None, bos_token_id=None, eos_token_id=1,
)  # fmt: skip
HYBRIDS = {"qwen3_next": QWEN3_NEXT, "olmo_hybrid": OLMO_HYBRID}


def flame_built(model_type: str, **values):
    config = transformers.AutoConfig.for_model(model_type, **values)
    torch.manual_seed(0)
    return instantiate(causal_lm_class(config), config)


def test_a_mixture_of_experts_class_keeps_its_grouped_experts_kernel(monkeypatch):
    """transformers lets a class choose its experts kernel when the source of the class's module uses its hook; flame's
    class answers for the class it wraps, whichever class transformers asked first in the process."""
    lm_class = causal_lm_class(transformers.AutoConfig.for_model("qwen3_next", **QWEN3_NEXT))
    for cls in lm_class.__mro__:
        monkeypatch.delattr(cls, "_can_set_experts_implementation_cached_value", raising=False)
    model = flame_built("qwen3_next", **QWEN3_NEXT)
    assert model.config._experts_implementation == "grouped_mm"


def random_call(heads: int, k_dim: int, v_dim: int, length: int, seed: int):
    """A layer's call: transformers' layers repeat q and k to the value heads before it."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k, v = randn(2, length, heads, k_dim), randn(2, length, heads, k_dim), randn(2, length, heads, v_dim)
    g = -torch.nn.functional.softplus(randn(2, length, heads))
    beta = torch.rand(2, length, heads, generator=generator)
    state = randn(2, heads, k_dim, v_dim) * 0.1
    return (q, k, v), dict(g=g, beta=beta, initial_state=state, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_the_gated_delta_rule_hook_runs_flames_op_with_the_references_result(model_type):
    """After flame builds the class, its module's chunk op on CPU tensors is flame's (FLA's Triton kernels, where
    transformers' hook sends them, need a GPU): output and final state equal transformers' own PyTorch reference on
    a length of 2 chunks and 11 tokens (float32, which the reference computes in; rtol 1e-4, atol 1e-5)."""
    flame_built(model_type, **HYBRIDS[model_type])
    module = inspect.getmodule(causal_lm_class(transformers.AutoConfig.for_model(model_type)))
    hooked = getattr(module, compat.TRANSFORMERS_GATED_DELTA_RULE)
    assert hooked.flame_routes
    reference = inspect.unwrap(hooked)
    tensors, options = random_call(4, 12, 20, 139, seed=len(model_type))
    output, state = hooked(*tensors, **options, cu_seq_lens_k=None)  # a layer's other kwargs are dropped
    expected_output, expected_state = reference(*tensors, **options)
    torch.testing.assert_close(output, expected_output, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_flame_built_hybrid_trains_on_the_cpu_with_the_references_logits(model_type, monkeypatch):
    """The whole model: flame's logits and a backward on the CPU, against the same model with transformers' PyTorch
    reference in its layers (float32; rtol 1e-4, atol 1e-5)."""
    model = flame_built(model_type, **HYBRIDS[model_type])
    tokens = torch.randint(0, 96, (2, 75), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)
    module = inspect.getmodule(type(model).flame_lm_class)
    reference = inspect.unwrap(getattr(module, compat.TRANSFORMERS_GATED_DELTA_RULE))
    monkeypatch.setattr(module, compat.TRANSFORMERS_GATED_DELTA_RULE, reference)
    with torch.no_grad():
        torch.testing.assert_close(logits.detach(), model(tokens), rtol=1e-4, atol=1e-5)


def test_compiled_calls_and_cpu_calls_take_flames_op_and_eager_gpu_calls_the_hook(monkeypatch):
    calls = []
    routed = compat._compiled_and_cpu_calls_on(
        lambda *a, **k: calls.append("flame"), lambda *a, **k: calls.append("hook")
    )
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    routed(torch.zeros(1))
    routed(on_gpu)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    routed(on_gpu)
    assert calls == ["flame", "hook", "flame"]


def test_routing_twice_wraps_once():
    flame_built("olmo_hybrid", **OLMO_HYBRID)
    module = inspect.getmodule(causal_lm_class(transformers.AutoConfig.for_model("olmo_hybrid")))
    first = getattr(module, compat.TRANSFORMERS_GATED_DELTA_RULE)
    flame_built("olmo_hybrid", **OLMO_HYBRID)
    assert getattr(module, compat.TRANSFORMERS_GATED_DELTA_RULE) is first


def grouped_call(seed: int):
    """An experts call of 5 experts (one of them given no tokens) on 37 tokens, as transformers sorts them."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(37, 24, generator=generator)
    weights = torch.randn(5, 24, 40, generator=generator)
    offsets = torch.tensor([9, 9, 20, 31, 37], dtype=torch.int32)
    return tokens, weights, offsets


def per_expert(tokens, weights, offsets, dtype):
    bounds = [0, *offsets.tolist()]
    return torch.cat(
        [tokens[a:b].to(dtype) @ weights[i].to(dtype) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grouped_mm_multiplies_in_the_autocast_dtype(compiled):
    """After flame builds a transformers class, its experts' grouped_mm under bfloat16 autocast multiplies in
    bfloat16 like autocast's matmul (both sides the same bfloat16 products, float32 accumulation: within 1e-2 of the
    largest value, where float32 products differ from them by ~4e-3 and a wrong expert by order one), eager and under
    torch.compile (where transformers' own takes grouped_mm for bfloat16 weights only); outside autocast it is
    transformers' own, in float32 (1e-5)."""
    from transformers.integrations import moe

    flame_built("qwen3_next", **QWEN3_NEXT)
    assert moe._grouped_mm.flame_autocast
    tokens, weights, offsets = grouped_call(seed=3)
    call = torch.compile(moe._grouped_mm, fullgraph=True) if compiled else moe._grouped_mm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(tokens, weights, offsets)
    assert out.dtype == torch.bfloat16
    expected = per_expert(tokens, weights, offsets, torch.bfloat16).float()
    assert (out.float() - expected).abs().max() <= 1e-2 * expected.abs().max()
    exact = per_expert(tokens, weights, offsets, torch.float32)
    plain = call(tokens, weights, offsets)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, exact, rtol=1e-5, atol=1e-5)
