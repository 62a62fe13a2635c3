"""Texts -> [BOS] + tokens + [EOS] documents; bad texts are skipped or kept, and counted; tokenizer loading."""

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flame.data import DataConfigError, build_tokenizer
from flame.data.tokenize import REPLACED_INVALID_UTF8, SKIPPED_EMPTY, SKIPPED_NOT_TEXT, DocumentEncoder
from tests.data.helpers import BOS, EOS, job_config


def test_documents_are_wrapped_in_bos_and_eos(tokenizer):
    encoded = DocumentEncoder(tokenizer)(["hello world", "second text"])
    for (tokens, note), text in zip(encoded, ["hello world", "second text"]):
        assert note is None and tokens.dtype == np.int32
        assert tokens.tolist() == [BOS] + tokenizer(text, add_special_tokens=False)["input_ids"] + [EOS]


def test_bad_texts_are_skipped_or_kept_and_noted(tokenizer):
    texts = ["fine", "", "  \n\t", None, 42, "bad \ufffd byte"]
    encoded = DocumentEncoder(tokenizer)(texts)
    assert [e.note for e in encoded] == [
        None,
        SKIPPED_EMPTY,
        SKIPPED_EMPTY,
        SKIPPED_NOT_TEXT,
        SKIPPED_NOT_TEXT,
        REPLACED_INVALID_UTF8,
    ]
    assert [e.tokens is None for e in encoded] == [False, True, True, True, True, False]


def test_no_bos_or_eos_when_the_tokenizer_has_none():
    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.train_from_iterator(
        ["abc abd abe"] * 10,
        trainers.BpeTrainer(
            vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bare)
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_id is None
    ((tokens, _),) = DocumentEncoder(tokenizer)(["abc abd"])
    assert tokens.tolist() == tokenizer("abc abd")["input_ids"]


def test_build_tokenizer_loads_the_configured_path(tokenizer):
    loaded = build_tokenizer(job_config())
    assert loaded.get_vocab() == tokenizer.get_vocab()


def test_build_tokenizer_names_a_missing_path(tmp_path):
    missing = tmp_path / "no-tokenizer"
    with pytest.raises(DataConfigError, match=f"model.tokenizer_path='{missing}'") as error:
        build_tokenizer(job_config("--model.tokenizer_path", str(missing)))
    assert "\n" not in str(error.value)
