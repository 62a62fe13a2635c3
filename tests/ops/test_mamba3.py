"""flame.ops.mamba3 (Mamba-3's scan, SISO and MIMO, as Mamba-2's scan over rank sub-tokens plus per-token terms)
against the token-by-token trapezoidal recurrence, float64, odd sizes: outputs, the states after the last token and
every input's gradient within 1e-10; packed documents against each document alone."""

import math

import pytest
import torch

from flame.ops.mamba3 import mamba3_scan, mamba3_scan_recurrent
from flame.ops.mamba3.rotary import cumulative_angles, rotate_halves, rotate_pairs


def inputs(batch, length, rank, groups, heads, state, head_dim, pairs, with_d=True, mimo=True, seed=0):
    """A MIMO layer's arguments (rank ``rank``, values through mimo_x, channels i and i + state / 2 rotated), or a
    SISO layer's (``mimo`` false: rank 1, the values x, channels 2i and 2i + 1 rotated)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    dt = torch.nn.functional.softplus(randn(batch, heads, length) - 1)
    adt = -torch.nn.functional.softplus(randn(batch, heads, length)) * dt
    return dict(
        q=randn(batch, length, rank, groups, state),
        k=randn(batch, length, rank, groups, state),
        v=randn(batch, length, heads, head_dim),
        adt=adt,
        dt=dt,
        trap=randn(batch, heads, length),
        q_bias=randn(heads, rank, state),
        k_bias=randn(heads, rank, state),
        angles=randn(batch, length, heads, pairs),
        mimo_x=randn(heads, rank, head_dim) if mimo else None,
        D=randn(heads) if with_d else None,
        pairwise=not mimo,
    )


CASES = {  # batch, length, rank, groups, heads, state, head_dim, pairs, with_d, mimo
    "siso-2-of-3-pairs": (2, 37, 1, 1, 3, 6, 5, 2, True, False),
    "siso-every-pair-two-groups": (1, 70, 1, 2, 4, 8, 3, 4, False, False),
    "siso-one-token": (1, 1, 1, 1, 1, 4, 2, 1, True, False),
    "siso-odd-state-chunk-border": (2, 65, 1, 3, 3, 5, 4, 2, True, False),
    "mimo-2-of-3-pairs": (2, 37, 3, 1, 3, 6, 5, 2, True, True),
    "mimo-every-pair-two-groups-chunk-border": (1, 70, 2, 2, 4, 8, 3, 4, False, True),
    "mimo-rank-4": (2, 19, 4, 1, 2, 6, 3, 1, True, True),
    "mimo-one-token": (1, 1, 2, 1, 1, 4, 2, 1, True, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_ssd_form_equals_the_recurrence_and_its_gradients(case):
    """y, the four states after the last token (the states enter the loss too, so that their gradients are compared
    as well) and every input's gradient within 1e-10."""
    arguments = inputs(*case)
    leaves = {name: t.requires_grad_() for name, t in arguments.items() if isinstance(t, torch.Tensor)}
    results = []
    for function in (mamba3_scan, mamba3_scan_recurrent):
        y, states = function(**arguments)
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        loss = (y * grad).sum() + sum((s * (i + 1)).sum() for i, s in enumerate(states))
        results.append((y, *states, *torch.autograd.grad(loss, list(leaves.values()))))
    names = ("y", "angle state", "ssm state", "k state", "v state", *(f"d{name}" for name in leaves))
    for name, ours, want in zip(names, *results, strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_trapezoid_hands_a_tokens_value_on_to_the_next_token():
    """With lambda = 1 (trap large) the rule is Euler's, Mamba-2's: y_t then depends on no token's share handed on;
    with lambda < 1 a token's value reaches the next output through (1 - lambda) dt exp(adt): changing v_0 changes
    y_1 differently under the two rules."""
    arguments = inputs(1, 4, 1, 1, 1, 4, 2, 1, with_d=False, mimo=False)
    changed = dict(arguments, v=arguments["v"].clone())
    changed["v"][:, 0] += 1.0
    euler = dict(trap=torch.full_like(arguments["trap"], 50.0))

    def effect(rule):
        return (
            mamba3_scan(**{**changed, **rule})[0][:, 1, 0] - mamba3_scan(**{**arguments, **rule})[0][:, 1, 0]
        )

    lam, dt, adt = 0.5, arguments["dt"][0, 0], arguments["adt"][0, 0]
    half = dict(trap=torch.zeros_like(arguments["trap"]))  # lambda = 1/2, the trapezoid
    theta = cumulative_angles(arguments["angles"], dt[None, :, None])
    q = rotate_pairs(arguments["q"][:, :, 0] + arguments["q_bias"][:, 0], theta)[0, 1, 0]
    k = rotate_pairs(arguments["k"][:, :, 0] + arguments["k_bias"][:, 0], theta)[0, 0, 0]
    # Token 0 reaches y_1 with weight exp(adt_1) (lambda dt_0 + (1 - lambda) dt_1) (q_1 . k_0).
    want_half = math.exp(adt[1]) * (lam * dt[0] + (1 - lam) * dt[1]) * (q @ k)
    want_euler = math.exp(adt[1]) * dt[0] * (q @ k)
    torch.testing.assert_close(effect(half)[0, 0], want_half.expand(2), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(effect(euler)[0, 0], want_euler.expand(2), rtol=1e-8, atol=1e-10)


def test_angles_accumulate_bounded_and_modulo_two_pi():
    angles = torch.full((1, 5, 1, 1), 100.0, dtype=torch.float64)  # tanh -> 1: pi per unit of dt
    dt = torch.full((1, 5, 1), 0.75, dtype=torch.float64)
    theta = cumulative_angles(angles, dt)[0, :, 0, 0]
    want = torch.tensor([0.75 * math.pi * (t + 1) % (2 * math.pi) for t in range(5)], dtype=torch.float64)
    torch.testing.assert_close(theta, want, rtol=0, atol=1e-12)


def test_rotate_halves_turns_channel_i_with_channel_i_plus_half_the_width():
    """Channels (i, i + 4) of 8 as the complex number x_i + j x_{i+4} times exp(j theta_i) for the 2 angles given;
    channels 2, 3, 6, 7 unchanged."""
    x = torch.randn(3, 8, dtype=torch.float64)
    theta = torch.randn(3, 2, dtype=torch.float64)
    turned = torch.complex(x[:, :2], x[:, 4:6]) * torch.exp(1j * theta)
    want = x.clone()
    want[:, :2], want[:, 4:6] = turned.real, turned.imag
    torch.testing.assert_close(rotate_halves(x, theta), want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("mimo", [False, True], ids=["siso", "mimo"])
def test_packed_documents_scan_as_each_document_alone(mimo):
    """cu_seqlens (a document of one token, one across a chunk border): y, each document's four states and every
    input's gradient equal the recurrence over each document alone, float64, 1e-10."""
    lengths = [6, 1, 70, 12]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    arguments = inputs(1, sum(lengths), 2 if mimo else 1, 1, 3, 6, 5, 2, mimo=mimo)
    leaves = {name: t.requires_grad_() for name, t in arguments.items() if isinstance(t, torch.Tensor)}
    time_dim = {"q": 1, "k": 1, "v": 1, "angles": 1, "adt": 2, "dt": 2, "trap": 2}  # the others are per head

    def document(start, end):
        return {
            name: t.narrow(time_dim[name], start, end - start) if name in time_dim and t is not None else t
            for name, t in arguments.items()
        }

    grad = torch.randn(1, sum(lengths), 2 if mimo else 1, 3, 5, dtype=torch.float64)
    y, states = mamba3_scan(**arguments, cu_seqlens=bounds)
    alone = [
        mamba3_scan_recurrent(**document(s, e)) for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist())
    ]
    expected_y = torch.cat([y for y, _ in alone], dim=1)
    expected_states = [torch.cat(parts) for parts in zip(*(states for _, states in alone), strict=True)]
    results = []
    for out, state in ((y, states), (expected_y, expected_states)):
        loss = (out * grad).sum() + sum((s * (i + 1)).sum() for i, s in enumerate(state))
        results.append((out, *state, *torch.autograd.grad(loss, list(leaves.values()))))
    names = ("y", "angle states", "ssm states", "k states", "v states", *(f"d{name}" for name in leaves))
    assert results[0][2].shape[0] == len(lengths)
    for name, ours, want in zip(names, *results, strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
