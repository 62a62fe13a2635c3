"""Packing: fixed windows reproduce the token stream; varlen rows mark documents and pieces; state resumes."""

import numpy as np
import pytest
import torch

from flame.data.packing import IGNORE_INDEX, SPLIT_DOCUMENTS, FixedWindowPacker, VarlenPacker, collate


class Documents:
    """A list of documents as a stateful stream (the packer's input)."""

    def __init__(self, documents, position=0):
        self.documents, self.position = documents, position

    def __next__(self):
        if self.position == len(self.documents):
            raise StopIteration
        self.position += 1
        return self.documents[self.position - 1]


def documents(lengths, start=10):
    """Documents of the given lengths with distinct, increasing tokens."""
    out, token = [], start
    for length in lengths:
        out.append(np.arange(token, token + length, dtype=np.int32))
        token += length
    return out


LENGTHS = [5, 1, 17, 40, 3, 8, 2, 30, 9]


def test_fixed_windows_overlap_by_one_and_cover_the_stream():
    docs = documents(LENGTHS)
    stream = np.concatenate(docs)
    rows = list(FixedWindowPacker(Documents(docs), seq_len=16))
    assert len(rows) == (len(stream) - 1) // 16
    inputs = torch.cat([r[0]["input"] for r in rows])
    labels = torch.cat([r[1] for r in rows])
    assert inputs.tolist() == stream[: len(inputs)].tolist()
    assert labels.tolist() == stream[1 : len(inputs) + 1].tolist()


@pytest.mark.parametrize("context_len", [6, 16])
def test_varlen_rows_mark_pieces_restart_positions_and_mask_document_ends(context_len):
    seq_len = 16
    docs = documents(LENGTHS)
    stats = {}
    rows = list(VarlenPacker(Documents(docs), seq_len, context_len, stats))
    stream = np.concatenate(docs)
    document_end = {int(d[-1]) for d in docs}
    inputs = torch.cat([r[0]["input"] for r in rows]).tolist()
    assert inputs == stream[: len(inputs)].tolist()
    for inputs_dict, labels in rows:
        cu, positions, tokens = inputs_dict["cu_seqlens"], inputs_dict["position_ids"], inputs_dict["input"]
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == seq_len
        lengths = (cu[1:] - cu[:-1]).tolist()
        assert all(0 < n <= context_len for n in lengths)
        assert positions.tolist() == [p for n in lengths for p in range(n)]
        for token, label in zip(tokens.tolist(), labels.tolist()):
            # Tokens are consecutive integers, so the next token of the same document is token + 1.
            assert label == (IGNORE_INDEX if token in document_end else token + 1)
        # A piece starts a row, a document, or the rest of a document cut after context_len tokens.
        document_start = {int(d[0]) for d in docs}
        for piece in range(1, len(lengths)):
            assert tokens[cu[piece]].item() in document_start or lengths[piece - 1] == context_len
    # The packer read every document (the last row stayed incomplete).
    assert stats == {SPLIT_DOCUMENTS: sum(n > context_len for n in LENGTHS)}


@pytest.mark.parametrize("varlen", [False, True])
def test_state_resumes_inside_a_document(varlen):
    docs = documents(LENGTHS * 3)

    def packer(stream):
        return VarlenPacker(stream, 16, 8, {}) if varlen else FixedWindowPacker(stream, 16)

    uninterrupted = list(packer(Documents(docs)))
    for stop in range(1, len(uninterrupted)):
        stream = Documents(docs)
        stopped = packer(stream)
        for _ in range(stop):
            next(stopped)
        resumed = packer(Documents(docs, stream.position))
        resumed.load_state_dict(stopped.state_dict())
        for expected, actual in zip(uninterrupted[stop:], resumed):
            assert all(torch.equal(expected[0][k], actual[0][k]) for k in expected[0])
            assert torch.equal(expected[1], actual[1])


def test_collate_stacks_rows_and_keeps_varlen_boundaries_flat():
    fixed = list(FixedWindowPacker(Documents(documents(LENGTHS)), 8))[:3]
    inputs, labels = collate(fixed)
    assert inputs["input"].shape == labels.shape == (3, 8)
    varlen_row = next(VarlenPacker(Documents(documents(LENGTHS)), 16, 16, {}))
    inputs, labels = collate([varlen_row])
    assert inputs["input"].shape == inputs["position_ids"].shape == labels.shape == (1, 16)
    assert inputs["cu_seqlens"].dim() == 1
