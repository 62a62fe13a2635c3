"""flame.ops.ssd (Mamba-2's scan): the chunked PyTorch implementation against the token-by-token recurrence, float64,
odd sizes; packed documents against each document alone; the kernel backend's refusals and the arguments it passes
FLA. tests/gpu/test_ssd.py checks FLA's kernel against the recurrence."""

import pytest
import torch

from flame.ops import dispatch
from flame.ops.ssd import fla_ssd_refuses, ssd, ssd_chunked
from flame.ops.ssd.naive import ssd_recurrent


def inputs(batch: int, length: int, heads: int, head_dim: int, state: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, head_dim, generator=generator, dtype=torch.float64)
    dt = torch.nn.functional.softplus(
        torch.randn(batch, length, heads, generator=generator, dtype=torch.float64)
    )
    A = -torch.rand(heads, generator=generator, dtype=torch.float64) * 4 - 0.1
    B = torch.randn(batch, length, heads, state, generator=generator, dtype=torch.float64)
    C = torch.randn(batch, length, heads, state, generator=generator, dtype=torch.float64)
    return x, dt, A, B, C


@pytest.mark.parametrize(
    ("batch", "length", "heads", "head_dim", "state", "chunk"),
    [(2, 37, 3, 5, 7, 8), (1, 64, 2, 4, 3, 64), (1, 1, 1, 3, 2, 16), (2, 100, 2, 6, 5, 64)],
)
def test_chunked_scan_equals_the_recurrence_and_its_gradients(batch, length, heads, head_dim, state, chunk):
    """Lengths that the chunk does not divide, shorter than one chunk, and exactly one; outputs, the last state and the
    gradients of every input within 1e-10 in float64."""
    leaves = [t.requires_grad_() for t in inputs(batch, length, heads, head_dim, state)]
    grad = torch.randn(batch, length, heads, head_dim, dtype=torch.float64)
    results = []
    for op in (lambda *a: ssd_chunked(*a, chunk=chunk), ssd_recurrent):
        out, state = op(*leaves)
        grads = torch.autograd.grad(out, leaves, grad)
        results.append((out, state, *grads))
    for name, ours, reference in zip(
        ("y", "last state", "dx", "ddt", "dA", "dB", "dC"), *results, strict=True
    ):
        torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_a_per_token_equals_the_recurrence_and_its_gradients():
    """A [batch, T, heads] (Mamba-3's data-dependent A) in the chunked form against the recurrence, float64, 1e-10;
    with every token's A equal to a per-head A, the result equals the per-head call's; dt None equals dt 1."""
    x, dt, A, B, C = inputs(2, 45, 3, 5, 4, seed=2)
    per_token = (
        -torch.rand(2, 45, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
    ).requires_grad_()
    leaves = [x.requires_grad_(), dt.requires_grad_(), per_token, B.requires_grad_(), C.requires_grad_()]
    grad = torch.randn_like(x)
    results = []
    for op in (lambda *a: ssd_chunked(*a, chunk=16), ssd_recurrent):
        out, state = op(*leaves)
        results.append((out, state, *torch.autograd.grad(out, leaves, grad)))
    for name, ours, reference in zip(
        ("y", "last state", "dx", "ddt", "dA", "dB", "dC"), *results, strict=True
    ):
        torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        broadcast = A.expand(2, 45, 3)
        for op in (lambda *a: ssd_chunked(*a, chunk=16), ssd_recurrent):
            torch.testing.assert_close(op(x, dt, broadcast, B, C), op(x, dt, A, B, C), rtol=1e-12, atol=1e-12)
            # dt None: x and the per-token A taken as they are, as with dt 1.
            ones = torch.ones_like(dt)
            torch.testing.assert_close(
                op(x, None, per_token, B, C), op(x, ones, per_token, B, C), rtol=1e-12, atol=1e-12
            )


def test_scan_carries_state_across_chunks():
    """A token's output depends on tokens of earlier chunks (the recurrence over chunks is not dropped): changing the
    first token changes the last one's output, through three chunk borders."""
    x, dt, A, B, C = inputs(1, 40, 2, 3, 4, seed=1)
    A = A / 100  # slow decay: the first token's share of the last output is far above rounding
    changed = x.clone()
    changed[:, 0] += 1.0
    difference = (
        (ssd_chunked(changed, dt, A, B, C, chunk=10)[0] - ssd_chunked(x, dt, A, B, C, chunk=10)[0])[:, -1]
        .abs()
        .max()
    )
    assert difference > 1e-6


def test_cpu_calls_run_the_chunked_code():
    x, dt, A, B, C = inputs(1, 70, 2, 3, 4)
    assert dispatch._TABLE["ssd"].implementation(x, dt, A, B, C) is ssd_chunked
    for ours, expected in zip(ssd(x, dt, A, B, C), ssd_chunked(x, dt, A, B, C), strict=True):
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "state", "refused"),
    [(torch.bfloat16, 64, 128, False), (torch.bfloat16, 5, 128, True), (torch.float16, 64, 7, True),
     (torch.float32, 5, 7, False)],
)  # fmt: skip
def test_fla_takes_odd_widths_in_float32_only(dtype, head_dim, state, refused):
    x = torch.zeros(1, 4, 2, head_dim, dtype=dtype)
    B = torch.zeros(1, 4, 2, state, dtype=dtype)
    reason = fla_ssd_refuses(x, torch.zeros(1, 4, 2), torch.zeros(2), B, B)
    assert (reason is not None) == refused, reason


DOCUMENTS = [5, 1, 70, 13]  # one token alone, one across a chunk border; 89 tokens


def test_packed_documents_scan_as_each_document_alone():
    """cu_seqlens: y, each document's last state and every gradient equal the scans of the documents one by one (the
    recurrence), float64, 1e-10."""
    leaves = [t.requires_grad_() for t in inputs(1, sum(DOCUMENTS), 3, 4, 5)]
    bounds = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    grad = torch.randn(leaves[0].shape, dtype=torch.float64)
    y, states = ssd(*leaves, cu_seqlens=bounds)
    packed = (y, states, *torch.autograd.grad((y * grad).sum() + states.sum(), leaves))
    alone = [
        ssd_recurrent(*(t if t.dim() == 1 else t[:, start:end] for t in leaves))
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
    ]
    y, states = torch.cat([y for y, _ in alone], dim=1), torch.cat([s for _, s in alone])
    expected = (y, states, *torch.autograd.grad((y * grad).sum() + states.sum(), leaves))
    assert packed[1].shape == (len(DOCUMENTS), 3, 4, 5)
    with pytest.raises(ValueError, match="one row"):
        ssd(*inputs(2, sum(DOCUMENTS), 3, 4, 5), cu_seqlens=bounds)
    for name, ours, want in zip(
        ("y", "states", "dx", "ddt", "dA", "dB", "dC"), packed, expected, strict=True
    ):
        torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_packed_documents_reach_flas_own_op_with_their_boundaries(monkeypatch):
    """On CUDA, packed documents go to FLA's chunk_simple_gla (flame's custom ops take no boundaries): C as queries,
    B as keys, dt x as values, dt A as the log decay, scale 1, the state value-first, the boundaries as given; its
    backward's Hopper refusal (FLA issue 640) served first, as the custom ops' backward does."""
    import fla.ops.simple_gla

    import flame.ops.gated_delta_rule.dqkwg_triton as dqkwg_triton
    from tests.ops.test_dispatch import PretendCuda

    calls = []
    monkeypatch.setattr(dqkwg_triton, "serve_where_fla_refuses", lambda: calls.append("served"))

    def fake(q, k, v, g, scale, output_final_state, state_v_first, cu_seqlens):
        calls.append(dict(q=q, k=k, v=v, g=g, scale=scale, final=output_final_state, v_first=state_v_first,
                          cu_seqlens=cu_seqlens))  # fmt: skip
        return torch.zeros_like(v), v.new_zeros(len(cu_seqlens) - 1, v.shape[2], v.shape[3], k.shape[3])

    monkeypatch.setattr(fla.ops.simple_gla, "chunk_simple_gla", fake)
    x, dt, A, B, C = inputs(1, 9, 2, 4, 6)
    bounds = torch.tensor([0, 4, 9], dtype=torch.int32)
    y, states = ssd(x.as_subclass(PretendCuda), dt, A, B, C, cu_seqlens=bounds)
    served, call = calls
    assert served == "served"
    assert call["q"] is C and call["k"] is B and call["cu_seqlens"] is bounds
    assert (call["scale"], call["final"], call["v_first"]) == (1.0, True, True)
    torch.testing.assert_close(call["v"], x * dt[..., None], rtol=0, atol=0)
    torch.testing.assert_close(call["g"], dt * A, rtol=0, atol=0)
    assert y.shape == x.shape and states.shape == (2, 2, 4, 6)
