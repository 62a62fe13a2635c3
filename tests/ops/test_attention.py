"""Softmax / softpick / rectified attention: the materialized reference against per-row Python computations of the
formulas (float64, rtol = atol = 1e-12), against FLA's naive_parallel_attn for softmax (float32, rtol = atol = 1e-5),
exact zeros where the formulas give zero, masked keys never counted, and torch.autograd.gradcheck. Fewer queries than
keys (queries aligned to the end of the keys) against the last rows of the full computation, outputs and gradients
(float64, rtol = atol = 1e-12)."""

import math
import sys

import pytest
import torch
from fla.ops.attn.naive import naive_parallel_attn

from flame.ops.attention import (
    IMPLS,
    SOFTPICK_EPS,
    attention,
    reference_attention,
    scale_queries_by_position,
    visibility_mask,
)
from flame.ops.varlen import position_ids_from_cu_seqlens

FLOAT64_TOL = {"rtol": 1e-12, "atol": 1e-12}
# (causal, window_size, cu_seqlens) for a sequence of 37 tokens.
MASKINGS = {
    "causal": (True, None, None),
    "window": (True, 5, None),
    "varlen": (True, None, [0, 11, 12, 37]),
    "varlen_window": (True, 4, [0, 20, 37]),
    "bidirectional": (False, None, None),
    "bidirectional_varlen": (False, None, [0, 11, 12, 37]),
}


def random(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def make_qkv(seq_len=37, heads=4, kv_heads=2, head_dim=16, seed=0, dtype=torch.float64, spread=2.0):
    """q [1, T, H, D], k/v [1, T, HKV, D]; `spread` scales q so that scores take both signs and reach past 1."""
    q = spread * random(1, seq_len, heads, head_dim, seed=seed, dtype=dtype)
    k = random(1, seq_len, kv_heads, head_dim, seed=seed + 1, dtype=dtype)
    v = random(1, seq_len, kv_heads, head_dim, seed=seed + 2, dtype=dtype)
    return q, k, v


def visible_keys(i, seq_len, causal, window_size, boundaries):
    """The keys query i sees, straight from the documented rule."""
    bos, eos = 0, seq_len
    for start, end in zip(boundaries[:-1], boundaries[1:]) if boundaries else []:
        if start <= i < end:
            bos, eos = start, end
    keys = range(bos, i + 1) if causal else range(bos, eos)
    return [j for j in keys if window_size is None or j > i - window_size]


def softpick_row(scores):
    """relu(e^x - 1) / (sum |e^x - 1| + eps e^max(x)): eps added in the max-shifted space, as the kernel does."""
    denominator = sum(abs(math.expm1(x)) for x in scores) + SOFTPICK_EPS * math.exp(max(scores))
    return [max(math.expm1(x), 0.0) / denominator for x in scores]


def rectified_row(scores):
    """Softmax over the non-negative scores; zero weight elsewhere, all zero when there is none."""
    kept = [x for x in scores if x >= 0]
    if not kept:
        return [0.0] * len(scores)
    total = sum(math.exp(x) for x in kept)
    return [math.exp(x) / total if x >= 0 else 0.0 for x in scores]


def softmax_row(scores):
    total = sum(math.exp(x) for x in scores)
    return [math.exp(x) / total for x in scores]


ROW_WEIGHTS = {"softpick": softpick_row, "rectified": rectified_row, "softmax": softmax_row}


def per_row_attention(q, k, v, impl, causal, window_size, boundaries):
    """One query row at a time, in Python floats for the weights; key/value head h // (H // HKV)."""
    _, seq_len, heads, head_dim = q.shape
    group = heads // k.shape[2]
    out = torch.zeros_like(q)
    for h in range(heads):
        for i in range(seq_len):
            keys = visible_keys(i, seq_len, causal, window_size, boundaries)
            scores = [float(q[0, i, h] @ k[0, j, h // group]) / math.sqrt(head_dim) for j in keys]
            for weight, j in zip(ROW_WEIGHTS[impl](scores), keys):
                out[0, i, h] += weight * v[0, j, h // group]
    return out


@pytest.mark.parametrize("impl", ["softmax", "softpick", "rectified"])
@pytest.mark.parametrize("masking", list(MASKINGS))
def test_matches_per_row_formula(impl, masking):
    causal, window_size, boundaries = MASKINGS[masking]
    q, k, v = make_qkv(seed=len(masking))
    cu_seqlens = None if boundaries is None else torch.tensor(boundaries, dtype=torch.int32)
    actual = attention(q, k, v, impl=impl, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens)
    expected = per_row_attention(q, k, v, impl, causal, window_size, boundaries)
    torch.testing.assert_close(actual, expected, **FLOAT64_TOL)


@pytest.mark.parametrize("window_size", [None, 6])
def test_softmax_matches_fla_naive_parallel_attn(window_size):
    q, k, v = make_qkv(seq_len=67, heads=6, kv_heads=2, head_dim=32, seed=1, dtype=torch.float32)
    expected, _ = naive_parallel_attn(q, k, v, window_size=window_size)
    actual = attention(q, k, v, impl="softmax", window_size=window_size)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_visibility_mask_by_hand():
    visible = visibility_mask(5, causal=True, window_size=2, cu_seqlens=torch.tensor([0, 2, 5]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible, expected)
    assert visibility_mask(5, causal=False) is None


def test_visibility_mask_with_fewer_queries_by_hand():
    """3 queries against 5 keys sit at positions 2, 3, 4."""
    causal = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    window = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(visibility_mask(3, causal=True, key_len=5), causal)
    assert torch.equal(visibility_mask(3, causal=True, window_size=2, key_len=5), window)
    assert visibility_mask(3, causal=False, key_len=5) is None


@pytest.mark.parametrize("impl", ["softmax", "softpick", "rectified"])
@pytest.mark.parametrize("masking", ["causal", "window", "bidirectional"])
@pytest.mark.parametrize("query_len", [1, 13])
def test_fewer_queries_equal_the_last_rows_of_the_full_attention(impl, masking, query_len):
    """The last query_len of 37 queries against all 37 keys (GQA): the output rows, dq of those rows and dk/dv equal
    those of the full computation whose earlier rows get a zero output gradient. With a window, the keys before the
    first query's window are seen by no query: dk = dv = 0 there, exactly."""
    causal, window_size, _ = MASKINGS[masking]
    q, k, v = make_qkv(seed=10)
    do = random(*q[:, -query_len:].shape, seed=11)

    def outputs_and_grads(q, k, v, do):
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = attention(q, k, v, impl=impl, causal=causal, window_size=window_size)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    out, dq, dk, dv = outputs_and_grads(q[:, -query_len:], k, v, do)
    full_do = torch.cat([torch.zeros_like(q[:, :-query_len]), do], dim=1)
    full_out, full_dq, full_dk, full_dv = outputs_and_grads(q, k, v, full_do)
    assert out.shape == do.shape
    torch.testing.assert_close(out, full_out[:, -query_len:], **FLOAT64_TOL)
    torch.testing.assert_close(dq, full_dq[:, -query_len:], **FLOAT64_TOL)
    torch.testing.assert_close(dk, full_dk, **FLOAT64_TOL)
    torch.testing.assert_close(dv, full_dv, **FLOAT64_TOL)
    assert dk.abs().amax() > 0 and dv.abs().amax() > 0
    if window_size is not None:
        unseen = 37 - query_len - window_size + 1
        assert torch.equal(dk[:, :unseen], torch.zeros_like(dk[:, :unseen]))
        assert torch.equal(dv[:, :unseen], torch.zeros_like(dv[:, :unseen]))
        assert dk[:, unseen].abs().amax() > 0


def test_window_of_one_attends_to_the_query_itself():
    q, k, v = make_qkv(seed=2)
    out = attention(q, k, v, impl="softmax", window_size=1)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=2), **FLOAT64_TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("query_len", [37, 11])
def test_a_window_as_long_as_the_keys_is_plain_causal_attention_and_reaches_the_kernel_as_none(
    impl, query_len, monkeypatch
):
    """Samba's 2048-token window over 2048-token rows hides no key: the call goes to the plain causal kernels
    (SDPA's on a GPU, not FLA's windowed one) with the same result; one token shorter, the window still bites."""
    q, k, v = make_qkv(seed=4)
    q = q[:, -query_len:]
    causal = attention(q, k, v, impl=impl)
    for window_size in (37, 38, 36):
        out = attention(q, k, v, impl=impl, window_size=window_size)
        assert torch.equal(out, causal) == (window_size >= 37), window_size
    attention_module = sys.modules["flame.ops.attention"]  # flame.ops.attention is also the function's name
    kernel, windows = attention_module.ATTENTION, []

    def recorded(*args, window_size, **kwargs):
        windows.append(window_size)
        return kernel(*args, window_size=window_size, **kwargs)

    monkeypatch.setattr(attention_module, "ATTENTION", recorded)
    for window_size in (None, 36, 37, 2048):
        attention(q, k, v, impl=impl, window_size=window_size)
    assert windows == [None, 36, None, None]


@pytest.mark.parametrize("score", [1e-6, 0.5, 5.0])
def test_softpick_eps_is_1e6_in_the_shifted_space(score):
    """One visible key with score x: weight (e^x - 1) / (|e^x - 1| + 1e-6 e^x); a half when x ~ 1e-6."""
    q = k = torch.full((1, 1, 1, 1), math.sqrt(score), dtype=torch.float64)
    v = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    expected_weight = math.expm1(score) / (math.expm1(score) + 1e-6 * math.exp(score))
    out = attention(q, k, v, impl="softpick", scale=1.0)
    torch.testing.assert_close(out, torch.full_like(v, expected_weight), **FLOAT64_TOL)


@pytest.mark.parametrize("impl", ["softpick", "rectified"])
def test_rows_without_positive_scores_are_exactly_zero(impl):
    """Keys with positive entries, queries with negative ones: every score < 0, so every row is zero.
    A zero query gives scores of exactly 0: zero for softpick, the plain mean of visible values for rectified."""
    q, k, v = make_qkv(seed=3)
    k = k.abs() + 0.1
    q = -(q.abs() + 0.1)
    q[:, 5] = 0.0
    out = attention(q, k, v, impl=impl)
    if impl == "softpick":
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
        assert torch.equal(out[:, 6:], torch.zeros_like(out[:, 6:]))
        torch.testing.assert_close(out[0, 5], v[0, :6].mean(0).repeat_interleave(2, dim=0), **FLOAT64_TOL)


@pytest.mark.parametrize("impl", ["softmax", "softpick", "rectified"])
@pytest.mark.parametrize("masking", ["causal", "window", "varlen"])
def test_masked_keys_are_never_counted(impl, masking):
    """Giving every masked key a huge score and value changes nothing, not a bit, and leaves gradients finite."""
    causal, window_size, boundaries = MASKINGS[masking]
    cu_seqlens = None if boundaries is None else torch.tensor(boundaries)
    q, k, v = make_qkv(seed=4)
    seq_len = q.shape[1]
    query_index = 20
    blocked = [
        j
        for j in range(seq_len)
        if j not in visible_keys(query_index, seq_len, causal, window_size, boundaries)
    ]
    q_one = q[:, query_index : query_index + 1].expand(-1, seq_len, -1, -1).clone()
    k_huge, v_huge = k.clone(), v.clone()
    k_huge[:, blocked] = 100 * q[:, query_index, ::2].sign()  # scores of several hundred
    v_huge[:, blocked] = 1e6

    def output_row(k, v):
        # Every query is q[query_index] so that row query_index sees exactly the blocked/visible split above.
        out = attention(q_one, k, v, impl=impl, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens)
        return out[:, query_index]

    assert torch.equal(output_row(k_huge, v_huge), output_row(k, v))
    k_huge.requires_grad_()
    (grad,) = torch.autograd.grad(output_row(k_huge, v_huge).sum(), k_huge)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[:, blocked], torch.zeros_like(grad[:, blocked]))


@pytest.mark.parametrize("impl", ["softpick", "rectified"])
@pytest.mark.parametrize(
    ("causal", "window_size", "boundaries"), [(True, None, None), (True, 2, None), (False, None, [0, 2, 6])]
)
def test_gradcheck(impl, causal, window_size, boundaries):
    cu_seqlens = None if boundaries is None else torch.tensor(boundaries)
    q, k, v = (x.requires_grad_() for x in make_qkv(seq_len=6, heads=2, kv_heads=1, head_dim=3, seed=5))

    def run(q, k, v):
        return attention(q, k, v, impl=impl, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens)

    assert torch.autograd.gradcheck(run, (q, k, v))


def test_bfloat16_output_dtype():
    q, k, v = make_qkv(seed=6, dtype=torch.bfloat16)
    for impl in ("softmax", "softpick", "rectified"):
        assert attention(q, k, v, impl=impl).dtype == torch.bfloat16


def test_scale_queries_by_position():
    q = random(2, 37, 3, 16, seed=7)
    head_scale = torch.tensor([0.3, 0.5, 1.0], dtype=torch.float64)
    positions = torch.arange(37)
    expected = q * head_scale[None, None, :, None] * torch.log(positions.double() + 2)[None, :, None, None]
    torch.testing.assert_close(scale_queries_by_position(q, head_scale, positions), expected, **FLOAT64_TOL)


def test_scaled_queries_restart_at_each_document():
    boundaries = [0, 11, 12, 37]
    q = random(1, 37, 3, 16, seed=8)
    head_scale = torch.full((3,), 0.3, dtype=torch.float64)
    packed = scale_queries_by_position(q, head_scale, position_ids_from_cu_seqlens(torch.tensor(boundaries)))
    separate = torch.cat(
        [
            scale_queries_by_position(q[:, bos:eos], head_scale, torch.arange(eos - bos))
            for bos, eos in zip(boundaries[:-1], boundaries[1:])
        ],
        dim=1,
    )
    torch.testing.assert_close(packed, separate, **FLOAT64_TOL)


def test_rejects_bad_arguments():
    q, k, v = make_qkv(seed=9)
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, impl="sigmoid")
    with pytest.raises(ValueError, match="causal"):
        attention(q, k, v, impl="softpick", causal=False, window_size=4)
    with pytest.raises(ValueError, match=">= 1"):
        attention(q, k, v, impl="softpick", window_size=0)
    with pytest.raises(ValueError, match="multiple"):
        attention(q[:, :, :3], k, v, impl="softmax")
    with pytest.raises(ValueError, match="at least as many keys as queries .*, got 37 queries, 36 keys"):
        attention(q, k[:, 1:], v[:, 1:], impl="softpick")
    with pytest.raises(
        ValueError, match="cu_seqlens needs as many queries as keys .*, got 17 queries, 37 keys"
    ):
        attention(q[:, 20:], k, v, impl="softmax", cu_seqlens=torch.tensor([0, 17, 37]))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_key_mask_equals_dropping_the_masked_keys_and_empty_rows_are_zero(impl):
    # Row 0: two padded positions in front (left padding); row 1: none. Queries after the padding must see what they
    # see without it; the padded queries of row 0 see no key and output 0.
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 7, 4, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[0, :2] = False
    out = reference_attention(q, k, v, impl=impl, key_mask=key_mask)
    unpadded = reference_attention(q[:1, 2:], k[:1, 2:], v[:1, 2:], impl=impl)
    torch.testing.assert_close(out[0, 2:], unpadded[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    torch.testing.assert_close(out[1], reference_attention(q[1:], k[1:], v[1:], impl=impl)[0], rtol=0, atol=0)
