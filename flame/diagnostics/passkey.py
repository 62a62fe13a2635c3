"""Passkey retrieval (Mohtashami and Jaggi 2023): can the model copy a number hidden at a random depth of a long
prompt of filler text?

A prompt of about ``length`` tokens (never more) is

    [BOS] <intro> <filler> ... <filler> The pass key is NNNNN. Remember it. NNNNN is the pass key. <filler> ...
    What is the pass key? The pass key is

with a 5-digit key drawn at random and the key sentence placed after a random fraction of the filler sentences.
Each part is tokenized on its own (without special tokens) and the ids are concatenated, so every prompt of a
length has the same filler. The model continues it greedily (flame.generation.sample, temperature 0) by as many
tokens as " NNNNN" takes plus one; a trial is correct when the first run of digits in the continuation is the key.
"""

import random
import re
from dataclasses import dataclass

import torch

from flame.errors import FlameError
from flame.generation import logits_of, sample

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


@dataclass
class PasskeyResult:
    length: int  # the requested prompt length
    prompt_tokens: int  # the longest prompt actually built
    trials: int
    correct: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials


def prompt_parts(tokenizer, key: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Token ids of the head (BOS and intro), one filler sentence, the key sentence and the question."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    head = ([] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]) + encode(INTRO)
    return head, encode(FILLER), encode(KEY.format(key=key)), encode(QUESTION)


def check_lengths(tokenizer, lengths: list[int]) -> None:
    """FlameError if a length is too short for a prompt without filler (with the longest key)."""
    head, _, key, question = prompt_parts(tokenizer, 99999)
    fixed = len(head) + len(key) + len(question)
    if lengths and min(lengths) < fixed:
        raise FlameError(
            f"a passkey prompt needs at least {fixed} tokens; --passkey_lengths has {min(lengths)}"
        )


def passkey_prompt(tokenizer, length: int, key: int, depth: float) -> list[int]:
    """Token ids of a prompt of at most ``length`` tokens with the key sentence after a ``depth`` fraction of the
    filler sentences (fewer than one filler sentence's worth of tokens short of ``length``)."""
    head, filler, key_ids, question = prompt_parts(tokenizer, key)
    repeats = max(0, length - len(head) - len(key_ids) - len(question)) // len(filler)
    before = round(depth * repeats)
    return head + filler * before + key_ids + filler * (repeats - before) + question


@torch.no_grad()
def passkey_accuracy(model, tokenizer, length: int, trials: int, seed: int = 0) -> PasskeyResult:
    rng = random.Random(f"{seed}-{length}")  # the same keys and depths for a length, whatever else is run
    device = next(model.parameters()).device
    correct, longest = 0, 0
    for _ in range(trials):
        key = rng.randint(10000, 99999)
        ids = passkey_prompt(tokenizer, length, key, rng.random())
        longest = max(longest, len(ids))
        new_tokens = len(tokenizer.encode(f" {key}", add_special_tokens=False)) + 1
        out = sample(
            logits_of(model),
            torch.tensor([ids], device=device),
            new_tokens,
            temperature=0.0,
            vocab_limit=len(tokenizer),
        )
        answer = re.search(r"\d+", tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True))
        correct += answer is not None and answer.group() == str(key)
    return PasskeyResult(length, longest, trials, correct)
