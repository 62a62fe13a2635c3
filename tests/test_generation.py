"""flame.generation.sample: greedy and sampled continuations from any logits function."""

import torch

from flame.generation import sample


def test_sample_respects_eos_and_vocab_limit():
    vocab, eos = 10, 2

    def logits_fn(ids):  # always prefers the last (padded) id, then eos
        logits = torch.zeros(ids.shape[0], ids.shape[1], vocab)
        logits[..., -1], logits[..., eos] = 5.0, 4.0
        return logits

    out = sample(logits_fn, torch.zeros(2, 1, dtype=torch.long), 5, temperature=0, eos_token_id=eos,
                          vocab_limit=vocab - 1)  # fmt: skip
    assert out.tolist() == [[0, eos], [0, eos]]
