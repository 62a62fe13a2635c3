"""The shipped sample tokenizer and corpus (flame/assets) load, round-trip text and fit each other."""

from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

ASSETS = Path(__file__).resolve().parents[2] / "flame" / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"
CORPUS_DIR = ASSETS / "corpus"

ROUND_TRIP_TEXTS = [
    "Return the number of items in a container.",
    " leading space, trailing space ",
    "Crème brûlée, naïve façade, Ångström, Straße, Ελληνικά, кириллица.",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "Emoji: 🤖🎉👍🏽 and a family 👨‍👩‍👧‍👦 (ZWJ sequence).",
    "tabs\t\tand   runs of    spaces\u00a0nbsp\u2003em-space",
    "\n\nblank lines\n\n\n\nand\r\nCRLF\rCR\n",
    'def f(x: int) -> int:\n    """Square x."""\n    return x ** 2  # {\'a\': [1, 2]}\n',
    "\x00\x01\x7f control characters, \ufffd replacement char, \U0010ffff max code point",
    "",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    data_files = {split: str(CORPUS_DIR / f"{split}.jsonl.gz") for split in ("train", "validation")}
    # A private cache keeps the test independent of (and out of) the user's HF datasets cache.
    return datasets.load_dataset("json", data_files=data_files, cache_dir=str(tmp_path_factory.mktemp("hf")))


def test_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == 4096
    assert tokenizer.vocab_size == 4096
    assert (tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token) == ("<unk>", "<s>", "</s>")
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Byte-level BPE covers every byte, so <unk> never appears.
    assert tokenizer.unk_token_id not in ids


def test_special_token_strings_in_text_round_trip(tokenizer):
    # Like every HF tokenizer, literal "<s>"/"</s>"/"<unk>" in the text encode to the special ids; decoding
    # still gives the text back. (The shipped corpus contains none of these strings.)
    text = "<s> and </s> and <unk> typed as plain text"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids[0] == tokenizer.bos_token_id


def test_no_special_tokens_added_by_default(tokenizer):
    # flame's data pipeline adds BOS/EOS itself; the tokenizer must not add them too.
    text = "Hello world"
    assert tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer(text)["input_ids"]
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert not {tokenizer.bos_token_id, tokenizer.eos_token_id} & set(ids)


def test_corpus_files_load(corpus):
    assert set(corpus) == {"train", "validation"}
    for split in corpus.values():
        assert split.num_rows > 0
        assert "text" in split.column_names
        assert all(isinstance(t, str) and t.strip() for t in split["text"])
    assert corpus["train"].num_rows > 10 * corpus["validation"].num_rows


def test_compresses_validation_split(tokenizer, corpus):
    texts = list(corpus["validation"]["text"])
    n_chars = sum(len(t) for t in texts)
    n_tokens = sum(len(ids) for ids in tokenizer(texts)["input_ids"])
    # The shipped tokenizer gets ~3.5 characters per token; a byte-level BPE without learned merges gets
    # about 1, so this catches a broken or untrained tokenizer with room to spare.
    assert n_chars / n_tokens > 3.0
