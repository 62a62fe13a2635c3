"""flame's fused softpick / rectified attention kernels (softpick_triton.py), run by Triton's interpreter on the CPU,
against the materialized reference (reference.py) evaluated in float64.

float32 inputs with odd lengths, GQA, sliding windows, packed documents of odd lengths (one of length 1), a padded
head dim (40 -> 64), non-contiguous inputs, and fewer queries than keys (the queries aligned to the end of the keys,
offsets that are no multiple of a block); the interpreter runs small unequal blocks (32 x 16 and 16 x 32), so that
every query block meets masked edge blocks, unmasked interior blocks and ragged ends. Limits, as the largest
error relative to the largest reference value of each result: 1e-5 for o, lse, and the rectified gradients (float32
rounding of length-100 sums; the float32 reference itself lands at 2e-7 to 1e-6); 2e-5 for softpick's dq/dk/dv,
whose FlashAttention-style backward subtracts dP - delta in float32 and drops the derivative of eps e^m (both of
order eps in a row whose weights nearly saturate: measured up to 7e-6). Exact (bitwise) checks: rows whose scores
are all <= 0, and rows whose visible keys are unchanged when masked keys change.
"""

import pytest
import torch

from flame.ops.attention import reference_attention, visibility_mask
from flame.ops.attention.softpick_triton import softpick_attention, softpick_attention_fwd
from tests.ops.helpers import softpick_reference_lse

LIMITS = {
    "softpick": {"o": 1e-5, "lse": 1e-5, "dq": 2e-5, "dk": 2e-5, "dv": 1e-5},
    "rectified": {"o": 1e-5, "lse": 1e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5},
}
# name: (batch, seq_len, heads, kv_heads, head_dim, window_size, document boundaries)
CASES = {
    "gqa": (2, 37, 4, 2, 64, None, None),
    "window_padded_dim": (1, 100, 2, 1, 40, 7, None),
    "varlen": (1, 100, 3, 3, 64, None, [0, 13, 14, 61, 100]),
    "varlen_window_padded_dim": (1, 70, 2, 1, 40, 20, [0, 5, 38, 70]),
}
# name: (batch, query_len, key_len, heads, kv_heads, head_dim, window_size); the queries are the last query_len
# positions. gqa and window_gqa have blocks that every row of a tile sees (run unmasked) next to edge blocks; the
# windows leave keys that no query sees, whole blocks of them (window_padded_dim: keys 0-64) or part of one
# (window_gqa: keys 0-20).
FEWER_QUERIES_CASES = {
    "gqa": (2, 45, 75, 4, 2, 64, None),
    "one_query": (1, 1, 50, 2, 1, 64, None),
    "window_padded_dim": (1, 29, 100, 2, 1, 40, 7),
    "window_gqa": (1, 50, 130, 4, 2, 64, 60),
}


def make_inputs(batch, seq_len, heads, kv_heads, head_dim, seed, fused=False):
    """q scaled by 2 so that scores take both signs and pass 1; fused=True slices q, k, v out of one tensor
    (non-contiguous head strides, as a fused qkv projection gives)."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, seq_len, heads + 2 * kv_heads, head_dim, generator=generator)
    qkv[:, :, :heads] *= 2
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
    return (q, k, v) if fused else (q.contiguous(), k.contiguous(), v.contiguous())


def relative_error(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def check_against_reference(q, k, v, variant, window_size, cu_seqlens, expected_lse):
    """Kernel output, lse and gradients against the float64 reference, within LIMITS; expected_lse [B, H, Tq]."""
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    scale = q.shape[-1] ** -0.5
    out, lse = softpick_attention_fwd(q, k, v, cu_seqlens, window_size, scale, variant)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(out, (q, k, v), do)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    expected = reference_attention(
        q64, k64, v64, impl=variant, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
    )
    expected_grads = torch.autograd.grad(expected, (q64, k64, v64), do.double())

    assert out.shape == q.shape and lse.shape == expected_lse.shape
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    finite = torch.isfinite(expected_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # +inf exactly for rectified rows without a score >= 0
    errors = {
        "o": relative_error(out, expected),
        "lse": relative_error(lse[finite], expected_lse[finite]),
        **{name: relative_error(g, e) for name, g, e in zip(("dq", "dk", "dv"), grads, expected_grads)},
    }
    failed = {name: f"{error:.1e}" for name, error in errors.items() if not error <= LIMITS[variant][name]}
    assert not failed, f"errors over the limits {LIMITS[variant]}: {failed}"


@pytest.mark.parametrize("variant", ["softpick", "rectified"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(variant, case):
    batch, seq_len, heads, kv_heads, head_dim, window_size, boundaries = CASES[case]
    cu_seqlens = None if boundaries is None else torch.tensor(boundaries, dtype=torch.int32)
    q, k, v = make_inputs(batch, seq_len, heads, kv_heads, head_dim, seed=len(case), fused=case == "gqa")
    expected_lse = softpick_reference_lse(q, k, variant, window_size, cu_seqlens, head_dim**-0.5)
    check_against_reference(q, k, v, variant, window_size, cu_seqlens, expected_lse)


@pytest.mark.parametrize("variant", ["softpick", "rectified"])
@pytest.mark.parametrize("case", list(FEWER_QUERIES_CASES))
def test_fewer_queries_match_float64_reference(variant, case):
    """The last query_len queries against all keys. A row's lse depends only on the keys it sees: the expected one
    is the last rows of the full (query_len = key_len) reference's."""
    batch, query_len, key_len, heads, kv_heads, head_dim, window_size = FEWER_QUERIES_CASES[case]
    q, k, v = make_inputs(batch, key_len, heads, kv_heads, head_dim, seed=len(case) + 20)
    full_lse = softpick_reference_lse(q, k, variant, window_size, None, head_dim**-0.5)
    q = q[:, -query_len:].contiguous()
    check_against_reference(q, k, v, variant, window_size, None, full_lse[:, :, -query_len:])


def test_refuses_more_queries_than_keys_and_packed_documents_with_fewer_queries():
    q, k, v = make_inputs(1, 20, 2, 1, 64, seed=1)
    with pytest.raises(ValueError, match="at least as many keys as queries .*, got 20 queries, 19 keys"):
        softpick_attention(q, k[:, 1:], v[:, 1:])
    with pytest.raises(
        ValueError, match="cu_seqlens needs as many queries as keys .*, got 8 queries, 20 keys"
    ):
        softpick_attention(q[:, 12:], k, v, cu_seqlens=torch.tensor([0, 12, 20]))


def test_softpick_attention_defaults_to_the_reference_scale():
    q, k, v = make_inputs(1, 21, 2, 2, 40, seed=3)
    expected = reference_attention(q.double(), k.double(), v.double(), impl="softpick")
    assert relative_error(softpick_attention(q, k, v), expected) <= 1e-5


@pytest.mark.parametrize("variant", ["softpick", "rectified"])
def test_rows_without_positive_scores(variant):
    """Queries opposite to every key (all scores < 0) give exactly 0 and gradient exactly 0, rectified saves
    lse = +inf for them; zero queries (all scores exactly 0) give 0 for softpick, the mean of the visible values for
    rectified (0 counts as kept there)."""
    q, k, v = make_inputs(1, 37, 4, 2, 64, seed=5)
    k = k.abs()
    negative_rows, zero_rows = [0, 3, 17, 18, 36], [5, 20, 33]
    q[:, negative_rows, 1:3] = -q[:, negative_rows, 1:3].abs()
    q[:, zero_rows, 1:3] = 0.0
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = softpick_attention_fwd(q, k, v, None, 9, 0.125, variant)
    (dq,) = torch.autograd.grad(out, q, torch.randn_like(out))

    zero_output_rows = negative_rows + zero_rows if variant == "softpick" else negative_rows
    assert torch.equal(out[:, zero_output_rows, 1:3], torch.zeros_like(out[:, zero_output_rows, 1:3]))
    assert torch.equal(dq[:, zero_output_rows, 1:3], torch.zeros_like(dq[:, zero_output_rows, 1:3]))
    assert out[:, negative_rows][:, :, [0, 3]].abs().amax() > 0  # the other heads of these rows do attend
    if variant == "rectified":
        assert torch.isposinf(lse[:, 1:3, negative_rows]).all()
        assert out[:, zero_rows, 1:3].abs().amin() > 0
    expected = reference_attention(
        q.double(), k.double(), v.double(), impl=variant, window_size=9, scale=0.125
    )
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("variant", ["softpick", "rectified"])
@pytest.mark.parametrize(
    ("window_size", "boundaries", "changed_keys"),
    [(None, None, range(20, 37)), (6, None, [11, 12]), (None, [0, 17, 37], range(0, 17))],
    ids=["future", "window", "other_document"],
)
def test_masked_keys_change_nothing(variant, window_size, boundaries, changed_keys):
    """Keys a row cannot see may hold anything (here values of 1e3): the row's output stays bit for bit the same,
    also where they share a block with visible keys."""
    cu_seqlens = None if boundaries is None else torch.tensor(boundaries)
    q, k, v = make_inputs(1, 37, 2, 1, 64, seed=11)
    changed_k, changed_v = k.clone(), v.clone()
    changed_k[:, changed_keys] = 1e3
    changed_v[:, changed_keys] = -1e3
    out = softpick_attention(q, k, v, variant=variant, window_size=window_size, cu_seqlens=cu_seqlens)
    changed = softpick_attention(
        q, changed_k, changed_v, variant=variant, window_size=window_size, cu_seqlens=cu_seqlens
    )
    visible = visibility_mask(37, True, window_size, cu_seqlens)
    blind_rows = ~visible[:, list(changed_keys)].any(1)
    assert 0 < blind_rows.sum() < 37
    assert torch.equal(out[:, blind_rows], changed[:, blind_rows])
    assert not torch.equal(out[:, ~blind_rows], changed[:, ~blind_rows])


def test_custom_op_registration():
    """Schema, fake (meta) implementation and autograd registration of the forward op, as torch.library checks
    them (the backward op runs inside the autograd check)."""
    q, k, v = make_inputs(1, 19, 2, 1, 16, seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(
        softpick_attention_fwd,
        (q, k, v, torch.tensor([0, 6, 19]), 5, 0.25, "softpick"),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_compiled_graph_equals_eager():
    """torch.compile(fullgraph=True) traces the op as one node; output and gradients equal eager bit for bit
    (aot_eager here, on the CPU; tests/gpu compiles with inductor)."""
    inputs = [x.requires_grad_() for x in make_inputs(1, 29, 2, 1, 64, seed=4)]

    def loss(q, k, v):
        return softpick_attention(q * 1.5, k, v, window_size=8).square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        value = fn(*inputs)
        results.append((value, *torch.autograd.grad(value, inputs)))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
