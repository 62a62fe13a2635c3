"""The run's tokenizer, and texts turned into token documents.

A document is ``[BOS] + tokens + [EOS]`` as an int32 array: BOS and EOS are added by flame (the tokenizer is
called with ``add_special_tokens=False``), each only if the tokenizer defines it (``bos_token_id`` /
``eos_token_id`` not None). Texts are tokenized in batches, in the dataloader workers when there are any.

Bad texts never stop training: a missing or non-string text and an empty (or whitespace-only) text are
skipped and counted; a text containing U+FFFD (what the readers put in place of bytes that are not UTF-8)
is kept and counted.

Every token of a document is a training target (the label of the token before it) unless the document marks it
as context only: such a token is stored as ``-1 - id`` (``as_context``). Chat data marks everything but the
assistant's replies that way (flame/data/chat.py); ``split_targets`` reads a document back.
"""

from typing import NamedTuple

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from flame.data.config import DataConfigError
from flame.errors import first_line

# Reasons a text is counted (the keys of the loader's data statistics).
SKIPPED_NOT_TEXT = "skipped_not_text"
SKIPPED_EMPTY = "skipped_empty"
REPLACED_INVALID_UTF8 = "replaced_invalid_utf8"


def as_context(tokens: np.ndarray) -> np.ndarray:
    """Mark tokens as context only: inputs, never targets."""
    return -1 - tokens


def split_targets(document: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, is each token a target) of a document."""
    if document.dtype.kind == "u":  # prepared token shards: plain text, every token a target
        return document, np.ones(len(document), dtype=bool)
    is_target = document >= 0
    return np.where(is_target, document, -1 - document), is_target


def build_tokenizer(job_config) -> PreTrainedTokenizerBase:
    """The HF tokenizer at ``job_config.model.tokenizer_path`` (a local directory or a hub name)."""
    path = job_config.model.tokenizer_path
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DataConfigError(
            f"cannot load the tokenizer at model.tokenizer_path='{path}': {first_line(e)}"
        ) from e


class Encoded(NamedTuple):
    """One text's outcome: its document (None when skipped) and what to count about it (None: nothing)."""

    tokens: np.ndarray | None
    note: str | None


class DocumentEncoder:
    """Batches of texts -> documents, with flame's BOS/EOS convention."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.prefix = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        self.suffix = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]

    def __call__(self, texts: list) -> list[Encoded]:
        results: list[Encoded | None] = [None] * len(texts)
        positions, valid = [], []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                results[i] = Encoded(None, SKIPPED_NOT_TEXT)
            elif not text.strip():
                results[i] = Encoded(None, SKIPPED_EMPTY)
            else:
                positions.append(i)
                valid.append(text)
        if valid:
            token_lists = self.tokenizer(
                valid, add_special_tokens=False, return_attention_mask=False, verbose=False
            )["input_ids"]
            for i, text, tokens in zip(positions, valid, token_lists):
                if not tokens:  # text made only of characters the tokenizer drops
                    results[i] = Encoded(None, SKIPPED_EMPTY)
                    continue
                document = np.array(self.prefix + tokens + self.suffix, dtype=np.int32)
                results[i] = Encoded(document, REPLACED_INVALID_UTF8 if "\ufffd" in text else None)
        return results
