"""The diagnostics' statistics on constructed inputs whose answers are known: sink statistics (every head on token 0,
uniform softmax, packed documents, sliding windows), sparsity of softpick with negative scores, the weights against
the attention kernel's reference, kurtosis and max |h| against direct formulas, and the passkey scorer."""

import math
import re

import pytest
import torch

from flame.diagnostics.activations import LayerActivations, kurtosis
from flame.diagnostics.attention import AttentionStats, head_weights
from flame.diagnostics.inputs import token_sequences
from flame.diagnostics.passkey import QUESTION, passkey_accuracy, passkey_prompt, prompt_parts
from flame.errors import FlameError
from flame.hf.export import load_tokenizer
from flame.ops.attention import reference_attention, visibility_mask
from tests.utils.helpers import TOKENIZER


def observe(q, k, impl="softmax", **kwargs) -> AttentionStats:
    stats = AttentionStats()
    stats(q, k, impl=impl, **kwargs)
    return stats


def test_every_head_attending_to_token_0_is_a_sink_head_in_every_layer():
    # Key 0 scores 50 for every query, every other key 0: softmax puts weight ~1 on key 0 in every head.
    q = torch.zeros(2, 9, 4, 8, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(2, 9, 2, 8, dtype=torch.float64)
    k[:, 0, :, 0] = 50.0 * math.sqrt(8)
    stats = AttentionStats()
    for layer in (0, 3):
        stats.layer = layer
        stats(q, k, impl="softmax")
    assert sorted(stats.layers) == [0, 3]
    for layer in stats.layers.values():
        assert layer.queries == 2 * 8  # query 0 of each sequence left out
        assert layer.sink_heads() == 4
        assert min(layer.first_token_attention) > 1 - 1e-15
    assert observe(q, -k).layers[0].sink_heads() == 0  # key 0 scored -50 instead


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2)])
def test_uniform_softmax_first_token_weight_is_mean_of_one_over_position(heads, kv_heads):
    seq_len = 12
    q, k = (
        torch.zeros(1, seq_len, heads, 4, dtype=torch.float64),
        torch.randn(1, seq_len, kv_heads, 4).double(),
    )
    layer = observe(q, k).layers[0]
    expected = sum(1 / (i + 1) for i in range(1, seq_len)) / (seq_len - 1)
    torch.testing.assert_close(
        torch.tensor(layer.first_token_attention), torch.full((heads,), expected), rtol=1e-12, atol=1e-12
    )
    assert layer.zero_fraction == 0 and layer.near_zero_fraction == 0
    assert layer.visible == heads * seq_len * (seq_len + 1) // 2


def test_first_token_of_packed_documents_and_sliding_windows():
    q, k = torch.zeros(1, 8, 1, 4, dtype=torch.float64), torch.zeros(1, 8, 1, 4, dtype=torch.float64)
    # Documents [0, 3) and [3, 8): the counted queries are positions 1, 2 and 1..4 of their documents.
    packed = observe(q, k, cu_seqlens=torch.tensor([0, 3, 8])).layers[0]
    assert packed.queries == 6
    expected = (1 / 2 + 1 / 3 + sum(1 / (p + 1) for p in range(1, 5))) / 6
    assert packed.first_token_attention[0] == pytest.approx(expected, rel=1e-12)
    # Window 2: only query 1 still sees key 0 (weight 1/2); the other 6 counted queries put 0 on it.
    windowed = observe(q, k, window_size=2).layers[0]
    assert windowed.first_token_attention[0] == pytest.approx(0.5 / 7, rel=1e-12)
    assert windowed.visible == 1 + 2 * 7


def test_softpick_sparsity_counts_the_keys_with_non_positive_scores():
    # Scores +1 (even keys) and -1 (odd keys): softpick gives exact zeros on the odd keys only.
    seq_len = 10
    q = torch.ones(1, seq_len, 1, 1, dtype=torch.float64)
    k = torch.tensor([1.0 if j % 2 == 0 else -1.0 for j in range(seq_len)], dtype=torch.float64)
    k = k.view(1, seq_len, 1, 1)
    softpick = observe(q, k, impl="softpick", scale=1.0).layers[0]
    odd_visible = sum((i + 1) // 2 for i in range(seq_len))  # odd keys j <= i
    visible = seq_len * (seq_len + 1) // 2
    assert softpick.visible == visible
    assert softpick.zero == odd_visible
    assert softpick.zero_fraction == odd_visible / visible
    assert softpick.near_zero_fraction == softpick.zero_fraction  # positive weights are >= 1/10 here
    assert observe(q, k, impl="softmax", scale=1.0).layers[0].zero == 0
    rectified = observe(q, k, impl="rectified", scale=1.0).layers[0]
    assert rectified.zero == odd_visible


@pytest.mark.parametrize("impl", ["softmax", "softpick", "rectified"])
@pytest.mark.parametrize("window_size", [None, 3])
def test_weights_times_values_are_the_attention_kernels_output(impl, window_size):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 11, 2, 8, generator=generator, dtype=torch.float64) * 2 for _ in range(3))
    visible = visibility_mask(11, True, window_size)
    out = torch.stack(
        [head_weights(q[0, :, h], k[0, :, h], impl, visible, 8**-0.5) @ v[0, :, h] for h in range(2)], dim=1
    )
    expected = reference_attention(q, k, v, impl=impl, window_size=window_size)[0]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_kurtosis_and_max_abs_accumulate_over_batches_as_one_direct_computation():
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 5, 7, generator=generator) ** 3 + 100 for _ in range(3)]  # far from 0, skewed
    batches[1][1, 3, 4] = -300.0  # the largest |h|: second sequence of a batch, token 3, channel 4
    stats = LayerActivations()
    for h in batches:
        stats.update(h)
    values = torch.cat([h.flatten() for h in batches]).double()
    centered = values - values.mean()
    direct = float((centered**4).mean() / (centered**2).mean() ** 2 - 3)
    assert stats.kurtosis == pytest.approx(direct, rel=1e-9)
    assert kurtosis(values) == pytest.approx(direct, rel=1e-12)
    assert (stats.max_abs, stats.max_position, stats.max_channel) == (300.0, 3, 4)
    # Symmetric +-1 values: m4 / m2^2 = 1, Fisher kurtosis -2; a Gaussian's is about 0.
    assert kurtosis(torch.tensor([1.0, -1.0] * 50)) == pytest.approx(-2.0)
    assert abs(kurtosis(torch.randn(200_000, generator=generator))) < 0.05


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TOKENIZER))


def test_sequences_start_with_bos_and_reject_short_text(tokenizer):
    sequences = token_sequences(["one document. " * 20, "another one. " * 20], tokenizer, 16, 3)
    assert sequences.shape == (3, 16) and bool((sequences[:, 0] == tokenizer.bos_token_id).all())
    with pytest.raises(FlameError, match="fewer than 3 sequences of 16"):
        token_sequences(["short"], tokenizer, 16, 3)


class Answering(torch.nn.Module):
    """Logits that spell " <key + offset>" and then EOS after a passkey prompt's question (offset 0: always right)."""

    def __init__(self, tokenizer, offset: int):
        super().__init__()
        self.tokenizer, self.offset = tokenizer, offset
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # passkey_accuracy reads the device off a parameter
        self.question = prompt_parts(tokenizer, 0)[3]

    def forward(self, ids):
        row = ids[0].tolist()
        end = max(i for i in range(len(row) + 1) if row[i - len(self.question) : i] == self.question)
        key = int(re.search(r"pass key is (\d+)", self.tokenizer.decode(row[:end])).group(1))
        answer = self.tokenizer.encode(f" {key + self.offset}", add_special_tokens=False)
        answer.append(self.tokenizer.eos_token_id)
        logits = torch.zeros(1, len(row), len(self.tokenizer))
        logits[0, -1, answer[min(len(row) - end, len(answer) - 1)]] = 1.0
        return logits


def test_passkey_prompt_and_scoring(tokenizer):
    ids = passkey_prompt(tokenizer, 300, 12345, 0.5)
    text = tokenizer.decode(ids)
    assert len(ids) <= 300 and ids[0] == tokenizer.bos_token_id and text.endswith(QUESTION)
    assert len(re.findall("grass is green", text.split("12345")[0])) == pytest.approx(
        len(re.findall("grass is green", text.split("12345")[-1])), abs=1
    )
    assert passkey_accuracy(Answering(tokenizer, 0), tokenizer, 200, trials=4).accuracy == 1.0
    assert passkey_accuracy(Answering(tokenizer, 1), tokenizer, 200, trials=4).accuracy == 0.0
