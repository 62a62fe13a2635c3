"""flame's replacement of FLA 0.6.0's ``fla.layers.attn.Attention`` against a float64 attention written out here with
FLA's conventions: per-head RMSNorm (eps 1e-5) before RoPE, rotate-half RoPE on the whole head with float32 angles,
GQA, a window of the query's own position and the window_size - 1 keys before it, scale 1/sqrt(head_dim)."""

import math

import pytest
import torch

from flame.models.layers.fla_attention import FLAAttention

HIDDEN, HEADS = 24, 3  # head_dim 8


def layer(dtype=torch.float64, seed=0, **kwargs) -> FLAAttention:
    """An FLAAttention with random weights everywhere (biases and norm weights too, so that each one counts)."""
    torch.manual_seed(seed)
    module = FLAAttention(hidden_size=HIDDEN, num_heads=HEADS, layer_idx=0, **kwargs)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return module.to(dtype)


def naive(module: FLAAttention, x: torch.Tensor, documents=None, positions=None, real=None) -> torch.Tensor:
    """float64 attention of one row x [T, C] with module's weights: documents [(start, end)] packed in the row,
    positions [T] (default: the index in the document), real [T] bool (padding: keys hidden, queries output 0)."""
    x = x.double()
    weights = {name: p.detach().double() for name, p in module.named_parameters()}
    seq_len, heads, kv_heads, dim = x.shape[0], module.num_heads, module.num_kv_heads, module.head_dim
    documents = documents or [(0, seq_len)]
    if positions is None:
        positions = torch.cat([torch.arange(end - start) for start, end in documents])
    real = torch.ones(seq_len, dtype=torch.bool) if real is None else real

    def project(name):
        y = x @ weights[f"{name}.weight"].T
        return y + weights[f"{name}.bias"] if f"{name}.bias" in weights else y

    q = project("q_proj").view(seq_len, heads, dim)
    k = project("k_proj").view(seq_len, kv_heads, dim)
    v = project("v_proj").view(seq_len, kv_heads, dim)
    if module.qk_norm:
        q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5) * weights["q_norm.weight"]
        k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + 1e-5) * weights["k_norm.weight"]
    # FLA's tables: inverse frequencies, positions and angles in float32, cos/sin then cast to the activations' dtype.
    inv_freq = 1.0 / (module.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(positions.float(), inv_freq)
    cos, sin = angles.cos().double(), angles.sin().double()
    half = dim // 2

    def rope(t):
        out = torch.empty_like(t)
        for i in range(half):  # pairs (i, i + half): the rotate-half layout
            c, s = cos[:, None, i], sin[:, None, i]
            out[..., i] = t[..., i] * c - t[..., i + half] * s
            out[..., i + half] = t[..., i + half] * c + t[..., i] * s
        return out

    q, k = rope(q), rope(k)
    out = torch.zeros(seq_len, heads, dim, dtype=torch.float64)
    window = module.window_size or seq_len
    for start, end in documents:
        for t in range(start, end):
            if not real[t]:
                continue
            keys = [j for j in range(max(start, t - window + 1), t + 1) if real[j]]
            for h in range(heads):
                g = h // (heads // kv_heads)
                scores = torch.stack([q[t, h] @ k[j, g] for j in keys]) / math.sqrt(dim)
                p = torch.softmax(scores, 0)
                out[t, h] = sum(p[n] * v[j, g] for n, j in enumerate(keys))
    return out.reshape(seq_len, heads * dim) @ weights["o_proj.weight"].T


VARIANTS = [
    {"num_kv_heads": 1},
    {"num_kv_heads": 1, "window_size": 4},
    {"num_kv_heads": 3, "qk_norm": True, "qkv_bias": True},
    {"num_kv_heads": 1, "qk_norm": True, "qkv_bias": True, "window_size": 5, "rope_theta": 500.0},
]


@pytest.mark.parametrize("kwargs", VARIANTS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_forward_equals_naive_attention(kwargs):
    module = layer(**kwargs)
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    out, attentions, cache = module(x)
    assert attentions is None and cache is None
    expected = torch.stack([naive(module, row) for row in x])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    out32, _, _ = layer(torch.float32, **kwargs)(x.float())
    torch.testing.assert_close(out32.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window_size", [None, 3])
def test_packed_documents_equal_each_document_alone(window_size):
    module = layer(num_kv_heads=1, qk_norm=True, window_size=window_size)
    bounds = [0, 5, 13, 20]
    x = torch.randn(1, 20, HIDDEN, dtype=torch.float64)
    packed, _, _ = module(x, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    alone = torch.cat([module(x[:, s:e])[0] for s, e in zip(bounds, bounds[1:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)
    documents = list(zip(bounds, bounds[1:]))
    torch.testing.assert_close(packed[0], naive(module, x[0], documents), rtol=0, atol=1e-10)


def test_padded_rows_hide_padding_and_keep_row_positions():
    # FLA's layer without a cache: positions are the row's indices (padding included), padded keys are hidden and
    # padded queries output 0.
    module = layer(num_kv_heads=1, window_size=4)
    x = torch.randn(2, 11, HIDDEN, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, 8:] = 0  # right padding
    out, _, _ = module(x, attention_mask=mask)
    for row in range(2):
        expected = naive(module, x[row], positions=torch.arange(11), real=mask[row].bool())
        torch.testing.assert_close(out[row], expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("window_size", [None, 4])
def test_decoding_with_fla_cache_equals_full_forward(window_size):
    from fla.models.cache_utils import Cache

    module = layer(num_kv_heads=1, qk_norm=True, window_size=window_size)
    x = torch.randn(2, 12, HIDDEN, dtype=torch.float64)
    full, _, _ = module(x)
    cache = Cache()
    pieces = [
        module(x[:, a:b], past_key_values=cache)[0] for a, b in [(0, 6), (6, 7), (7, 10), (10, 11), (11, 12)]
    ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-10)


def test_refuses_a_full_attention_mask():
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch_size, seq_len\]"):
        layer()(torch.randn(1, 4, HIDDEN, dtype=torch.float64), attention_mask=torch.ones(1, 4, 4))


@pytest.mark.parametrize("kwargs", VARIANTS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_flame_transformer_attention_computes_the_same_from_the_same_state_dict(kwargs):
    # flame's own transformer family reads FLA's checkpoints: its layer under FLA's names gives FLA's layer's output.
    from flame.models.layers.attention import Attention

    module = layer(**kwargs)
    flame_kwargs = {k: v for k, v in kwargs.items() if k != "rope_theta"}
    own = Attention(HIDDEN, HEADS, rope_theta=module.rope_theta, norm_eps=1e-5, **flame_kwargs).double()
    own.load_state_dict(module.state_dict(), strict=True)
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(own(x, torch.arange(13).expand(2, 13)), module(x)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("window_size", [None, 3])
def test_left_padded_decoding_with_fla_cache_equals_each_row_alone(window_size):
    # With a cache, FLA numbers a left-padded row's tokens from its first real one (generation of a padded batch).
    from fla.models.cache_utils import Cache

    module = layer(num_kv_heads=1, window_size=window_size)
    x = torch.randn(2, 10, HIDDEN, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    cache = Cache()
    pieces = [module(x[:, :8], attention_mask=mask[:, :8], past_key_values=cache)[0]]
    for t in (8, 9):
        pieces.append(module(x[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache)[0])
    out = torch.cat(pieces, dim=1)
    torch.testing.assert_close(out[0, 3:], module(x[:1, 3:])[0][0], rtol=0, atol=1e-10)
    torch.testing.assert_close(out[0, :3], torch.zeros(3, HIDDEN, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(out[1], module(x[1:])[0][0], rtol=0, atol=1e-10)


def deltaformer_u(q, k, v, beta, cu_seqlens=None):
    """DeltaFormer's u in float64, one position at a time within each document: u_t = v_t - beta_t sum_{s<t} w_ts u_s,
    w_t the softmax over s < t of q_t . k_s / sqrt(D) (u_0 = v_0)."""
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    edges = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    u = torch.empty_like(v)
    for start, end in zip(edges, edges[1:]):
        for t in range(start, end):
            if t == start:
                u[:, t] = v[:, t]
                continue
            scores = torch.einsum("bhd,bshd->bhs", q[:, t], k[:, start:t]) / math.sqrt(q.shape[-1])
            mixed = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), u[:, start:t])
            u[:, t] = v[:, t] - beta[:, t, :, None] * mixed
    return u


@pytest.fixture
def deltaformer_u_on_cpu(monkeypatch):
    """FLA's ParallelDeltaformerFunction (Triton) answered by deltaformer_u, so the composition runs on the CPU."""
    from fla.ops.deltaformer import parallel

    def apply(q, k, v, beta, chunk, cu_seqlens):
        assert 1 <= chunk <= k.shape[1]
        return deltaformer_u(q, k, v, beta, cu_seqlens)

    monkeypatch.setattr(parallel.ParallelDeltaformerFunction, "apply", staticmethod(apply))


def deltaformer_inputs(batch: int, seq_len: int, heads: int = 3, dim: int = 7):
    generator = torch.Generator().manual_seed(seq_len)
    q, k, v = (
        torch.randn(batch, seq_len, heads, dim, dtype=torch.float64, generator=generator) for _ in range(3)
    )
    return q, k, v, torch.rand(batch, seq_len, heads, dtype=torch.float64, generator=generator)


# FLA's naive_deltaformer_attn computes u in float32 (up to ~1e-7 from float64 here, at unit-scale inputs).
NAIVE_FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}


def test_deltaformer_attention_equals_flas_naive_op(deltaformer_u_on_cpu):
    """flame's last step (causal softmax attention of q over k and u) against FLA's own float64 reference of the
    whole op, naive_deltaformer_attn; with packed documents, each document alone; with right padding, the real
    prefix alone and zeros after it. The reference computes u in float32 whatever its inputs (NAIVE_FLOAT32); a
    wrong scale, mask or order of the steps differs by order one."""
    from fla.ops.deltaformer.naive import naive_deltaformer_attn

    from flame.models.layers.fla_attention import deltaformer_attention

    q, k, v, beta = deltaformer_inputs(2, 37)
    torch.testing.assert_close(
        deltaformer_attention(q, k, v, beta), naive_deltaformer_attn(q, k, v, beta), **NAIVE_FLOAT32
    )

    q, k, v, beta = deltaformer_inputs(1, 41)
    edges = [0, 13, 14, 41]
    packed = deltaformer_attention(q, k, v, beta, cu_seqlens=torch.tensor(edges, dtype=torch.int32))
    alone = torch.cat(
        [naive_deltaformer_attn(*(x[:, s:e] for x in (q, k, v, beta))) for s, e in zip(edges, edges[1:])],
        dim=1,
    )
    torch.testing.assert_close(packed, alone, **NAIVE_FLOAT32)

    q, k, v, beta = deltaformer_inputs(2, 29)
    mask = torch.ones(2, 29, dtype=torch.long)
    mask[1, 20:] = 0
    padded = deltaformer_attention(q, k, v, beta, attention_mask=mask)
    torch.testing.assert_close(
        padded[0], naive_deltaformer_attn(q[:1], k[:1], v[:1], beta[:1])[0], **NAIVE_FLOAT32
    )
    row = naive_deltaformer_attn(*(x[1:, :20] for x in (q, k, v, beta)))[0]
    torch.testing.assert_close(padded[1, :20], row, **NAIVE_FLOAT32)
    assert not padded[1, 20:].any()
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        deltaformer_attention(q, k, v, beta, cu_seqlens=torch.tensor([0, 29], dtype=torch.int32))


def test_fla_deltaformer_models_call_flames_op_without_flash_attn():
    import fla.layers.deltaformer

    from flame.models import build_model, model_args_from_dict
    from flame.models.layers.fla_attention import deltaformer_attention

    config = {
        "model_type": "deltaformer",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_heads": 2,
    }
    args, _ = model_args_from_dict(config, impl="fla")
    with torch.device("meta"):
        build_model(args)
    assert fla.layers.deltaformer.deltaformer_attn is deltaformer_attention


def naive_flash_attention(q, k, v, causal, left, cu_seqlens=None, scale=None):
    """flash-attn's documented semantics, in float64 loops: query i (aligned to the end of the keys) sees key j when
    j <= i (causal), j >= i - left (left >= 0) and both are in one document; query head h reads key/value head
    h // (H // HKV)."""
    q, k, v = (x.double() for x in (q, k, v))
    batch, q_len, heads, dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    scale = dim**-0.5 if scale is None else scale
    documents = torch.zeros(k_len, dtype=torch.long)
    if cu_seqlens is not None:
        for start in cu_seqlens[1:-1].tolist():
            documents[start:] += 1
    rows = []
    for b in range(batch):
        for i in range(q_len):
            at = i + k_len - q_len
            keys = [
                j
                for j in range(k_len)
                if (not causal or j <= at) and (left < 0 or j >= at - left) and documents[j] == documents[at]
            ]
            for h in range(heads):
                g = h // (heads // kv_heads)
                weights = torch.softmax(k[b, keys, g] @ q[b, i, h] * scale, 0)
                rows.append(weights @ v[b, keys, g])
    return torch.stack(rows).view(batch, q_len, heads, dim)


@pytest.mark.parametrize(
    "causal, window_size, scale",
    [(True, (5, 0), None), (True, (-1, -1), 0.3), (True, (0, 0), None), (False, (-1, -1), None)],
)
def test_flash_attn_func_on_flame_equals_flash_attns_semantics(causal, window_size, scale):
    """flame's flash_attn_func (FLA's rodimus and NSA call it for their sliding windows without flash-attn) against
    flash-attn's semantics written out in float64 (GQA, odd sizes), outputs and gradients to 1e-5 in float32."""
    from flame.models.layers.fla_attention import flash_attn_func

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 37, 4, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 37, 2, 8, generator=generator, requires_grad=True) for _ in range(2))
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window_size)
    want = naive_flash_attention(q, k, v, causal, window_size[0], scale=scale)
    assert_output_and_gradients_close(out, want, (q, k, v), generator, tolerance=1e-5)


def assert_output_and_gradients_close(out, want, inputs, generator, tolerance: float) -> None:
    """A float32 op's output and its inputs' gradients (for one random output gradient) against the float64
    reference ``want`` computed from the same inputs, within ``tolerance`` absolute and relative."""
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad(out, inputs, grad.float())
    expected = torch.autograd.grad(want, inputs, grad)
    for name, g, e in zip("qkv", got, expected, strict=True):
        torch.testing.assert_close(g.double(), e.double(), rtol=tolerance, atol=tolerance, msg=name)


def test_flash_attn_varlen_func_on_flame_keeps_documents_apart():
    from flame.models.layers.fla_attention import flash_attn_varlen_func

    generator = torch.Generator().manual_seed(4)
    cu_seqlens = torch.tensor([0, 11, 12, 30], dtype=torch.int32)
    q = torch.randn(30, 4, 8, generator=generator)
    k, v = (torch.randn(30, 4, 8, generator=generator) for _ in range(2))
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 18, 18, causal=True, window_size=(3, 0))
    want = naive_flash_attention(q[None], k[None], v[None], True, 3, cu_seqlens=cu_seqlens)[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_flash_attn_functions_on_flame_refuse_what_flames_attention_does_not_compute():
    from flame.models.layers.fla_attention import flash_attn_func, flash_attn_varlen_func

    q = torch.randn(1, 5, 2, 4)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="dropout"):
        flash_attn_func(q, q, q, dropout_p=0.1, causal=True)
    with pytest.raises(ValueError, match="only with causal=True"):
        flash_attn_func(q, q, q, causal=False, window_size=(2, 2))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_func(q, q, q, causal=True, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="same tokens"):
        flash_attn_varlen_func(
            q[0], q[0], q[0], cu, torch.tensor([0, 4, 5], dtype=torch.int32), 5, 4, causal=True
        )
