"""flame.ops.attention.observe_attention: one call per attention layer, in layer order, with the kernel's q and k;
nothing once the context has ended, also when it ended by an exception."""

import pytest
import torch

from flame.ops.attention import observe_attention, reference_attention
from tests.utils.helpers import tiny_model, tokens


def test_one_call_per_attention_layer_in_layer_order():
    # Attention at layers 0 and 2 with different head counts, GatedDeltaNet at 1 and 3: the calls say which ran.
    model = tiny_model(
        "gated_deltanet",
        num_hidden_layers=4,
        attn=[{"layers": [0], "num_heads": 2}, {"layers": [2], "num_heads": 4, "window_size": 5}],
    )
    events = []
    for name, block in model.layers.items():
        block.register_forward_pre_hook(lambda module, args, name=name: events.append(f"layer {name}"))

    def observer(q, k, **attention_args):
        events.append((tuple(q.shape), tuple(k.shape), attention_args))

    x = tokens(batch=2, length=9)
    with torch.no_grad(), observe_attention(observer):
        model(x)
    default = {"impl": "softmax", "causal": True, "cu_seqlens": None, "scale": None}
    assert events == [
        "layer 0",
        ((2, 9, 2, 32), (2, 9, 2, 32), {**default, "window_size": None}),
        "layer 1",
        "layer 2",
        ((2, 9, 4, 16), (2, 9, 4, 16), {**default, "window_size": 5}),
        "layer 3",
    ]
    events.clear()
    with torch.no_grad():
        model(x)
    assert [e for e in events if not isinstance(e, str)] == []


def test_observer_gets_the_tensors_the_kernel_attends_with():
    model = tiny_model("transformer", attn_impl="parallel_softpick_attn")
    seen = []
    with torch.no_grad(), observe_attention(lambda q, k, **args: seen.append((q, k, args))):
        model(tokens(batch=1, length=7))
    assert len(seen) == 2
    # Replaying layer 0's call with its own value projection reproduces the layer's attention output.
    block = model.layers["0"]
    q, k, args = seen[0]
    x = block.attn_norm(model.embeddings(tokens(batch=1, length=7)))
    v = block.attn.v_proj(x).view(1, 7, -1, block.attn.head_dim)
    with torch.no_grad():
        out = block.attn.o_proj(reference_attention(q, k, v, **args).reshape(1, 7, -1))
        positions = torch.arange(7)[None]
        torch.testing.assert_close(out, block.attn(x, positions))


def test_observer_is_removed_when_the_context_raises():
    model = tiny_model("transformer")
    calls = []
    with pytest.raises(RuntimeError, match="stop"), observe_attention(lambda q, k, **args: calls.append(1)):
        raise RuntimeError("stop")
    with torch.no_grad():
        model(tokens(batch=1, length=5))
    assert calls == []
